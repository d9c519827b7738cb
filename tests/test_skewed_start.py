"""Ranks that start at different speeds: one rank's start-up work (loading weights, the first
touch of its KV cache) can take longer than ``distributed_timeout_s`` beyond its peer's. That
timeout is for hangs once the ranks run; the start must not fail for it. Found as a flaky
`test_elastic_recovery` case: a 1 GiB KV cache backed by huge pages took one rank 4 s more
than the other in this VM (the test's timeout: 4 s), and the start failed at the all-to-all's
setup exchange ("Timed out waiting 4000ms") or named the loading rank stuck.

Every case carries a timeout; the LLM's ranks are stopped before it returns.
"""

from __future__ import annotations

import os
import textwrap
import time

import pytest
from test_partial_recovery import _rank_set

from batchgen import LLM, SamplingParams
from batchgen.config import ParallelConfig
from batchgen.distributed.rank_set import RankFailedError

# Loaded into every rank process: rank 1's model load sleeps first (a slow disk, a big cache).
SLOW_RANK = textwrap.dedent(
    """
    import os, sys
    if os.environ.get("BATCHGEN_TEST_SLOW_RANK_S"):
        import time

        import batchgen.engine.llm_engine as llm_engine

        _load = llm_engine.load_engine_model

        def _slow(*args, **kwargs):
            if "--rank" in sys.argv and sys.argv[sys.argv.index("--rank") + 1] == "1":
                time.sleep(float(os.environ["BATCHGEN_TEST_SLOW_RANK_S"]))
            return _load(*args, **kwargs)

        llm_engine.load_engine_model = _slow
    """
)

PROMPTS = ["the skewed start", "a second prompt, longer than the first one"]


@pytest.mark.timeout(240)
def test_a_rank_slower_to_start_than_the_timeout_does_not_fail_the_start(
    checkpoint_dir, tmp_path, monkeypatch
):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_RANK)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(hook) + (os.pathsep + path if path else ""))
    monkeypatch.setenv("BATCHGEN_TEST_SLOW_RANK_S", "9")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    started = time.monotonic()
    llm = LLM(
        str(checkpoint_dir("mixtral")),
        data_parallel_size=2,
        enable_expert_parallel=True,
        distributed_timeout_s=4.0,
    )
    try:
        assert time.monotonic() - started >= 9  # rank 1 did start late
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()
    monkeypatch.delenv("BATCHGEN_TEST_SLOW_RANK_S")
    ref = LLM(str(checkpoint_dir("mixtral"))).generate(PROMPTS, greedy, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in ref]


def _timed_rank_set():
    rank_set = _rank_set(2, 1)
    rank_set.parallel = ParallelConfig(
        data_parallel_size=2,
        expert_parallel_size=1,
        enable_elastic_recovery=True,
        distributed_timeout_s=4.0,
    )
    return rank_set


def test_a_rank_still_starting_is_not_named_stuck_after_the_timeout():
    """Unheard for 10 s against a 4 s timeout while it starts (no `Ready` yet): still
    starting, within `STARTING_SILENCE_S`; once ready, 10 s of silence names it stuck."""
    from batchgen.distributed.rank_messages import STARTING_SILENCE_S

    assert STARTING_SILENCE_S >= 60
    rank_set = _timed_rank_set()
    slow = rank_set.ranks[1]
    slow.last_seen -= 10
    assert rank_set._collect(timeout=0) == []
    slow.ready_at = time.monotonic() - 20
    with pytest.raises(RankFailedError, match="rank 1 .* silent for 10 s") as caught:
        rank_set._collect(timeout=0)
    assert caught.value.ranks == [1]


def test_a_rank_still_starting_is_named_stuck_after_the_start_bound():
    from batchgen.distributed.rank_messages import STARTING_SILENCE_S

    rank_set = _timed_rank_set()
    rank_set.ranks[0].last_seen -= STARTING_SILENCE_S + 5
    with pytest.raises(RankFailedError, match="rank 0 .* silent for"):
        rank_set._collect(timeout=0)
