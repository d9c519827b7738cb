"""Elastic recovery whose restart hangs: every rank started again after a failure hangs while
loading (the model on a stalled file system), heartbeating all along, so none is silent and
none waits for another. The restart is bounded by the job's last start
(`RankSet.start_took`); before, the job waited for their `Ready` for ever.

Every case carries a timeout and checks that no rank process is left.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from rank_hooks import assert_no_ranks_left, slow_rank_start
from test_distributed_faults import _drain, _greedy

import batchgen.distributed.rank_messages as rank_messages
from batchgen import LLM
from batchgen.distributed import recovery
from batchgen.distributed.rank_set import RankFailedError


@pytest.mark.timeout(300)
def test_a_restart_whose_ranks_all_hang_ends_within_the_budget(
    checkpoint_dir, tmp_path, monkeypatch
):
    """Rank 1 is killed mid-job; both ranks of its group (every rank: one group) start again
    and hang in their model load. Each restart is named after the bound (here 5 s, or the
    last start's time) and counted; the budget spent, the job fails with the documented error
    instead of hanging, and no rank is left."""
    armed = tmp_path / "hang"
    slow_rank_start(tmp_path, monkeypatch, 3600, at="load", armed=armed)
    monkeypatch.setattr(rank_messages, "STARTING_SILENCE_S", 5.0)
    monkeypatch.setattr(recovery, "MAX_RECOVERIES", 1)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = LLM(
        str(checkpoint_dir("mixtral")),
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_elastic_recovery=True,
        distributed_timeout_s=4.0,
    )
    engine = llm.llm_engine
    took = engine.rank_set.start_took
    try:
        assert took is not None and took > 0
        # Long enough not to finish before the kill (a step with no request left does not
        # read the ranks, so a finished request would leave the death unseen).
        engine.add_request("a", "hello", _greedy(2000))
        engine.step()
        assert "a" in engine.requests, "the request finished before the kill"
        armed.touch()  # the ranks started from now on hang
        killed = time.monotonic()
        os.kill(engine._ranks[1].pid, signal.SIGKILL)
        pattern = (
            r"rank 0 .* still loading \d+ s longer than the job's last start took \(\d+ s\)"
            r".*gave up after 1 restarts"
        )
        with pytest.raises(RankFailedError, match=pattern):
            _drain(engine, timeout=240)
        # the restart's load, then its lag past max(4 s, 5 s, the last start's time)
        assert time.monotonic() - killed < 2 * took + 60
    finally:
        llm.shutdown()
    assert_no_ranks_left(before)
