"""Slow rank processes for start-up tests: a `sitecustomize` on ``PYTHONPATH`` that every rank
process a test starts from then on loads (not the test's own process: it has started), which
makes one step of the rank's start sleep first, as a slow disk, a large cache or a hung device
would:

- ``load``: the engine's model load (before the all-to-all's setup, the group's first
  collective after the rendezvous);
- ``after_transport``: the engine's set-up after the all-to-all's setup (its executor), so
  after the group's first collective and before the rank says `Ready`;
- ``before_join``: the device's set-up (`resolve_device`, where CUDA initialises), before the
  group's rendezvous.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

SLOW_START = textwrap.dedent(
    """
    import os, sys
    if os.environ.get("BATCHGEN_TEST_SLOW_LOAD_S"):
        import time

        def _slow(fn):
            only = os.environ.get("BATCHGEN_TEST_SLOW_RANK")

            def slow(*args, **kwargs):
                rank = sys.argv[sys.argv.index("--rank") + 1] if "--rank" in sys.argv else None
                armed = os.environ.get("BATCHGEN_TEST_SLOW_IF")
                if (not only or rank == only) and (not armed or os.path.exists(armed)):
                    time.sleep(float(os.environ["BATCHGEN_TEST_SLOW_LOAD_S"]))
                return fn(*args, **kwargs)

            return slow

        _at = os.environ.get("BATCHGEN_TEST_SLOW_AT", "load")
        if _at == "load":
            import batchgen.engine.llm_engine as llm_engine

            llm_engine.load_engine_model = _slow(llm_engine.load_engine_model)
        elif _at == "after_transport":
            import batchgen.engine.llm_engine as llm_engine

            llm_engine.StageExecutor = _slow(llm_engine.StageExecutor)
        elif _at == "before_join":
            import batchgen.engine.engine_setup as engine_setup

            engine_setup.resolve_device = _slow(engine_setup.resolve_device)
        else:
            raise ValueError(f"BATCHGEN_TEST_SLOW_AT: unknown step {_at!r}")
    """
)

STEPS = ("load", "after_transport", "before_join")


def slow_rank_start(
    tmp_path,
    monkeypatch,
    seconds: float,
    rank: int | None = None,
    at: str = "load",
    armed: Path | None = None,
) -> None:
    """Rank processes started from now on (every one, or only ``rank``) sleep ``seconds``
    before step ``at`` of their start (one of `STEPS`, see the module docstring), heartbeating
    meanwhile; with ``armed``, only while that file exists (create it to slow the ranks started
    again after a failure, not the first ones). Undone with ``monkeypatch``.

    Raises:
        ValueError: ``at`` is not one of `STEPS`.
    """
    if at not in STEPS:
        raise ValueError(f"at must be one of {STEPS}, got {at!r}")
    if armed is None:
        monkeypatch.delenv("BATCHGEN_TEST_SLOW_IF", raising=False)
    else:
        monkeypatch.setenv("BATCHGEN_TEST_SLOW_IF", str(armed))
    hook = tmp_path / "slow_load_hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SLOW_START)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(hook) + (os.pathsep + path if path else ""))
    monkeypatch.setenv("BATCHGEN_TEST_SLOW_LOAD_S", str(seconds))
    monkeypatch.setenv("BATCHGEN_TEST_SLOW_AT", at)
    if rank is None:
        monkeypatch.delenv("BATCHGEN_TEST_SLOW_RANK", raising=False)
    else:
        monkeypatch.setenv("BATCHGEN_TEST_SLOW_RANK", str(rank))


def slow_model_load(tmp_path, monkeypatch, seconds: float, rank: int | None = None) -> None:
    """`slow_rank_start` at the model load."""
    slow_rank_start(tmp_path, monkeypatch, seconds, rank, "load")


def assert_no_ranks_left(before: set[int], wait_s: float = 30.0) -> None:
    """Wait up to ``wait_s`` for every child process of this test started since ``before``
    (pids) to end; fail naming those still running (zombies count as ended)."""
    import time

    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        left = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        ]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    assert not left, f"ranks left running: {left}"
