"""Slow rank processes for start-up tests: a `sitecustomize` on ``PYTHONPATH`` that every rank
process a test starts from then on loads (not the test's own process: it has started), which
makes the engine's model load sleep first, as a slow disk or a large cache would."""

from __future__ import annotations

import os
import textwrap

SLOW_LOAD = textwrap.dedent(
    """
    import os, sys
    if os.environ.get("BATCHGEN_TEST_SLOW_LOAD_S"):
        import time

        import batchgen.engine.llm_engine as llm_engine

        _load = llm_engine.load_engine_model
        _only = os.environ.get("BATCHGEN_TEST_SLOW_RANK")

        def _slow(*args, **kwargs):
            rank = sys.argv[sys.argv.index("--rank") + 1] if "--rank" in sys.argv else None
            if not _only or rank == _only:
                time.sleep(float(os.environ["BATCHGEN_TEST_SLOW_LOAD_S"]))
            return _load(*args, **kwargs)

        llm_engine.load_engine_model = _slow
    """
)


def slow_model_load(tmp_path, monkeypatch, seconds: float, rank: int | None = None) -> None:
    """Rank processes started from now on (every one, or only ``rank``) sleep ``seconds``
    before they load the model, heartbeating meanwhile. Undone with ``monkeypatch``."""
    hook = tmp_path / "slow_load_hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SLOW_LOAD)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(hook) + (os.pathsep + path if path else ""))
    monkeypatch.setenv("BATCHGEN_TEST_SLOW_LOAD_S", str(seconds))
    if rank is None:
        monkeypatch.delenv("BATCHGEN_TEST_SLOW_RANK", raising=False)
    else:
        monkeypatch.setenv("BATCHGEN_TEST_SLOW_RANK", str(rank))
