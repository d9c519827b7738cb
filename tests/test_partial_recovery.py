"""Elastic recovery that keeps the survivors: a killed rank stops only its restart group (its
expert-parallel group, or itself when experts are replicated); that group starts again and
gets its unfinished requests back, while the other groups run on with theirs, in the same
processes. Every request is still answered exactly once with the tokens one process gives.

Every case carries a timeout and stops its rank processes before returning.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
from test_distributed_faults import _greedy

from batchgen import LLM


def _prompts(n: int) -> list[str]:
    return [f"survivor prompt {i} " * (1 + i % 4) for i in range(n)]


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    llm = LLM(str(checkpoint_dir("mixtral")))
    outs = llm.generate(_prompts(12), _greedy(24), use_tqdm=False)
    return {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(outs)}


def _kill_mid_job(llm: LLM, victim: int) -> tuple[dict, list[str], set[str], dict[int, int]]:
    """Run 12 requests in two waves and SIGKILL rank ``victim`` right after the second wave
    reached the ranks. Returns the tokens, the order of answers, the requests the victim's
    group held at the kill and the pids before it."""
    engine = llm.llm_engine
    prompts, got, answered = _prompts(12), {}, []
    deadline = time.monotonic() + 240

    def step() -> None:
        assert time.monotonic() < deadline, "the job did not finish: a hang"
        for out in engine.step():
            answered.append(out.request_id)
            got[out.request_id] = out.outputs[0].token_ids

    for i in range(6):
        engine.add_request(f"r{i}", prompts[i], _greedy(24))
    while len(answered) < 2:
        step()
    for i in range(6, 12):
        engine.add_request(f"r{i}", prompts[i], _greedy(24))
    for rank in engine._ranks:
        engine._flush(rank)
    pids = {r.rank: r.pid for r in engine._ranks}
    group = set(_group_of(engine, victim))
    held = {i for i, e in engine.requests.items() if e.rank in group}
    os.kill(pids[victim], signal.SIGKILL)
    while engine.has_unfinished_requests():
        step()
    return got, answered, held, pids


def _group_of(engine, rank: int) -> list[int]:
    from batchgen.distributed.layout import resolve_layout

    return resolve_layout(engine.parallel).restart_group(rank)


@pytest.mark.timeout(300)
def test_replicated_ranks_run_on_while_a_killed_rank_is_replaced(
    checkpoint_dir, reference, caplog
):
    caplog.set_level(logging.WARNING, logger="batchgen.distributed.recovery")
    llm = LLM(
        str(checkpoint_dir("mixtral")), data_parallel_size=2, enable_elastic_recovery=True
    )
    engine = llm.llm_engine
    try:
        got, answered, held, pids = _kill_mid_job(llm, victim=1)
        assert sorted(answered) == sorted(reference)  # each exactly once
        assert got == reference
        assert engine._ranks[0].pid == pids[0]  # rank 0 ran on, in the same process
        assert engine._ranks[1].pid != pids[1]
        metrics = llm.get_metrics()
        assert metrics["recoveries"] == 1
        # only what rank 1 held was re-queued (held: rank 1's unfinished requests at the kill)
        assert 1 <= metrics["requests_requeued"] <= len(held) < 12
        assert any("ranks [1] (the others run on)" in r.getMessage() for r in caplog.records)
    finally:
        llm.shutdown()


@pytest.mark.timeout(400)
def test_one_expert_parallel_group_restarts_while_the_other_runs_on(
    checkpoint_dir, reference, caplog
):
    """Four ranks in two expert-parallel groups of two ({0, 1} and {2, 3}): rank 3 killed
    stops rank 2 too (their collectives broke), and only they start again."""
    caplog.set_level(logging.WARNING, logger="batchgen.distributed.recovery")
    llm = LLM(
        str(checkpoint_dir("mixtral")),
        data_parallel_size=4,
        expert_parallel_size=2,
        enable_elastic_recovery=True,
    )
    engine = llm.llm_engine
    try:
        got, answered, held, pids = _kill_mid_job(llm, victim=3)
        assert sorted(answered) == sorted(reference)
        assert got == reference
        now = {r.rank: r.pid for r in engine._ranks}
        assert (now[0], now[1]) == (pids[0], pids[1])  # the other group ran on
        assert now[2] != pids[2] and now[3] != pids[3]
        metrics = llm.get_metrics()
        assert metrics["recoveries"] == 1
        assert metrics["requests_requeued"] <= len(held) < 12
        assert any("ranks [2, 3] (the others run on)" in r.getMessage() for r in caplog.records)
    finally:
        llm.shutdown()


class _Conn:
    closed = False

    def close(self) -> None:
        self.closed = True


def _rank_set(world: int, ep: int):
    """A `RankSet` with fake ranks and no processes, for its message handling alone."""
    import queue

    from batchgen.config import ParallelConfig
    from batchgen.distributed.rank_handle import RankHandle
    from batchgen.distributed.rank_set import RankSet

    rank_set = object.__new__(RankSet)
    rank_set.parallel = ParallelConfig(
        data_parallel_size=world, expert_parallel_size=ep, enable_elastic_recovery=True
    )
    rank_set.ranks = [RankHandle(r, _Conn(), "host", 100 + r) for r in range(world)]
    rank_set._inbox, rank_set._held = queue.Queue(), []
    rank_set.failure, rank_set.closed = None, False
    return rank_set


def test_outputs_that_arrive_with_a_failure_are_kept_and_only_the_group_stops():
    """Rank 2 dies in the same read as rank 0's outputs and rank 3's report of the broken
    collective: the failure names rank 2, stops its group {2, 3} only, and rank 0's outputs
    come back from `take_held` (a survivor forgets its outputs once sent)."""
    from batchgen.distributed import protocol as msg
    from batchgen.distributed.mailbox import CLOSED
    from batchgen.distributed.rank_set import RankFailedError

    rank_set = _rank_set(4, 2)
    r = rank_set.ranks
    outputs = msg.Outputs(0, [], 3)
    rank_set._inbox.put((r[0], outputs))
    rank_set._inbox.put((r[2], CLOSED))
    rank_set._inbox.put((r[3], msg.Failed(3, "RuntimeError: Connection closed by peer")))
    rank_set._inbox.put((r[1], msg.Heartbeat(1, 5, "step")))
    with pytest.raises(RankFailedError) as caught:
        rank_set.receive(1.0)
    failure = caught.value
    assert failure.recoverable and failure.ranks == [2] and failure.lost == [2, 3]
    assert "rank 2" in str(failure) and "died" in str(failure)
    assert [h.retired for h in r] == [False, False, True, True]
    assert r[2].conn.closed and r[3].conn.closed and not r[0].conn.closed
    assert rank_set.take_held() == [(r[0], outputs)]
    assert not rank_set.closed
    # what a retired rank still sends is dropped
    rank_set.failure = None
    rank_set._inbox.put((r[3], CLOSED))
    rank_set._inbox.put((r[1], outputs))
    assert rank_set.receive(0.5) == [(r[1], outputs)]


def test_each_restart_group_is_its_own_world():
    from batchgen.distributed import protocol as msg

    rank_set = _rank_set(4, 2)
    joined = {
        r: (h, msg.Hello(r, 100 + r, "host", False, 5000 + r), f"10.0.0.{r}")
        for r, h in enumerate(rank_set.ranks)
    }
    worlds = rank_set._worlds(joined)
    assert worlds == {
        0: ("tcp://10.0.0.0:5000", [0, 1]),
        1: ("tcp://10.0.0.0:5000", [0, 1]),
        2: ("tcp://10.0.0.2:5002", [2, 3]),
        3: ("tcp://10.0.0.2:5002", [2, 3]),
    }
    replicated = _rank_set(2, 1)
    joined = {
        r: (h, msg.Hello(r, 1, "h", False, 6000 + r), "127.0.0.1")
        for r, h in enumerate(replicated.ranks)
    }
    assert replicated._worlds(joined) == {
        0: ("tcp://127.0.0.1:6000", [0]),
        1: ("tcp://127.0.0.1:6001", [1]),
    }
