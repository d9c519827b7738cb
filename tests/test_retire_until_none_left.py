"""Elastic recovery with no restart left (``MAX_RECOVERIES`` 0): on 3 ranks with replicated
experts, two groups killed one after the other are retired and the job runs on, on rank 0,
with one process's tokens; then the last group is killed: the job ends with an error saying
no group is left, and every output finished before it has been returned.

The case carries a timeout and stops the processes it started before returning.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_distributed_faults import _greedy

from batchgen import LLM
from batchgen.distributed.rank_set import RankFailedError


def _drain_until(engine, done, got, errors, seconds):
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "a hang"
        for out in engine.step():
            assert out.request_id not in got and out.request_id not in errors, "twice"
            if out.error is not None:
                errors[out.request_id] = out.error
            else:
                got[out.request_id] = out.outputs[0].token_ids


@pytest.mark.timeout(300)
def test_two_groups_retired_one_after_the_other_then_the_last_one_lost(
    checkpoint_dir, monkeypatch
):
    from batchgen.distributed import recovery

    path = str(checkpoint_dir("mixtral"))
    prompts = [f"retire prompt {i} " * (1 + i % 3) for i in range(6)]
    outs = LLM(path).generate(prompts, _greedy(40), use_tqdm=False)
    want = [o.outputs[0].token_ids for o in outs]
    monkeypatch.setattr(recovery, "MAX_RECOVERIES", 0)  # every lost group is retired
    llm = LLM(path, data_parallel_size=3, expert_parallel_size=1, enable_elastic_recovery=True)
    engine = llm.llm_engine
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, _greedy(40), data_parallel_rank=i % 3)
            engine.add_request(f"f{i}", prompt, _greedy(40))
        got, errors = {}, {}
        for victim in (1, 2):
            os.kill(engine._ranks[victim].pid, signal.SIGKILL)
            _drain_until(engine, lambda v=victim: engine._ranks[v].retired, got, errors, 60)
        assert llm.get_metrics()["ranks_retired"] == [1, 2]
        _drain_until(engine, lambda: not engine.has_unfinished_requests(), got, errors, 120)
        for i in range(6):  # free requests: all finish, rank 1's and 2's again on rank 0
            assert got[f"f{i}"] == want[i]
            if f"p{i}" in got:  # pinned: finished before its rank was killed, or failed
                assert got[f"p{i}"] == want[i]
            else:
                assert f"data_parallel_rank {i % 3} was retired" in errors[f"p{i}"]
        assert {f"p{i}" for i in (0, 3)} <= set(got)
        # the last group: the job ends, saying why, after returning what finished
        engine.add_request("last", prompts[0], _greedy(300))
        engine.add_request("quick", prompts[1], _greedy(1))
        before = {}
        _drain_until(engine, lambda: "quick" in before, before, errors, 60)
        os.kill(engine._ranks[0].pid, signal.SIGKILL)
        with pytest.raises(RankFailedError, match="no other group is left to run on"):
            _drain_until(engine, lambda: False, before, errors, 60)
        assert before["quick"] == want[1][:1] and "last" not in before
        with pytest.raises(RankFailedError, match="no other group is left"):
            engine.add_request("after", prompts[0], _greedy(4))
    finally:
        llm.shutdown()
