"""Elastic recovery without a group lost for good: a restart group that cannot start again
(ranks of another machine's launcher, here a headless rank) is retired while the others run
on; its requests finish on the survivors with one process's tokens, requests pinned to it fail
one by one; and an engine nobody calls still hands a connected replacement its setup.

Every case carries a timeout and stops the processes it started before returning.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from dist_helpers import free_port
from test_distributed_faults import _greedy

from batchgen import LLM


def _prompts(n: int) -> list[str]:
    return [f"lost group prompt {i} " * (1 + i % 3) for i in range(n)]


@pytest.mark.timeout(300)
def test_a_headless_group_killed_mid_job_is_retired_and_the_job_completes(
    checkpoint_dir, monkeypatch
):
    """Rank 0 local, rank 1 headless (`python -m batchgen.distributed.launch`, which this
    frontend cannot start again). Rank 1 is SIGKILLed with requests on it: it is retired, its
    free requests finish on rank 0 with one process's tokens, the one pinned to it fails with
    an error naming it, every request is answered once, and a new request pinned to it is
    refused."""
    path = str(checkpoint_dir("mixtral"))
    prompts = _prompts(6)
    want = {
        f"r{i}": o.outputs[0].token_ids
        for i, o in enumerate(LLM(path).generate(prompts, _greedy(40), use_tqdm=False))
    }
    port = free_port()
    monkeypatch.setenv("BATCHGEN_DP_AUTHKEY", "lost-group-secret")
    headless = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgen.distributed.launch",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(port),
            "--data-parallel-size-local",
            "1",
            "--data-parallel-start-rank",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    llm = None
    try:
        llm = LLM(
            path,
            data_parallel_size=2,
            data_parallel_size_local=1,
            data_parallel_address="127.0.0.1",
            data_parallel_rpc_port=port,
            enable_elastic_recovery=True,
        )
        engine = llm.llm_engine
        assert engine._ranks[1].process is None  # not started by this frontend
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, _greedy(40), data_parallel_rank=i % 2)
        engine.add_request("pinned", prompts[0], _greedy(40), data_parallel_rank=1)
        for i, prompt in enumerate(prompts):  # free requests, some of them on rank 1
            engine.add_request(f"f{i}", prompt, _greedy(40))
        for rank in engine._ranks:
            engine._flush(rank)
        on_rank1 = {i for i, e in engine.requests.items() if e.rank == 1}
        assert "pinned" in on_rank1 and any(i.startswith("f") for i in on_rank1)
        os.kill(engine._ranks[1].pid, signal.SIGKILL)
        got, errors = {}, {}
        deadline = time.monotonic() + 200
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the job did not finish: a hang"
            for out in engine.step():
                assert out.request_id not in got and out.request_id not in errors, "twice"
                if out.error is not None:
                    errors[out.request_id] = out.error
                else:
                    got[out.request_id] = out.outputs[0].token_ids
        # the requests pinned to rank 1 before it was killed, and "pinned": failed, named
        assert set(errors) == {"pinned", "r1", "r3", "r5"}, errors
        assert all("data_parallel_rank 1 was retired" in e for e in errors.values()), errors
        expected = {f"r{i}": want[f"r{i}"] for i in (0, 2, 4)}
        expected.update({f"f{i}": want[f"r{i}"] for i in range(6)})
        assert got == expected  # rank 1's free requests too, re-run on rank 0
        metrics = llm.get_metrics()
        assert metrics["ranks_retired"] == [1] and metrics["recoveries"] == 0
        assert metrics["requests_requeued"] == len(on_rank1 - set(errors))
        assert len(metrics["ranks"]) == 1
        with pytest.raises(ValueError, match="data_parallel_rank 1 was retired"):
            engine.add_request("late", prompts[0], _greedy(4), data_parallel_rank=1)
        assert headless.wait(30) is not None  # its launcher ends with its rank
    finally:
        if llm is not None:
            llm.shutdown()
        if headless.poll() is None:
            headless.kill()
        headless.wait(10)


@pytest.mark.timeout(360)
def test_an_idle_engine_hands_a_replacement_its_setup(checkpoint_dir):
    """Rank 1 is killed, its failure found by a `step`, and then nobody calls the engine: the
    replacement still gets its setup, loads and is taken in (by the frontend's background
    thread), the recovery ends, and the thread exits. Rank 1 then gives rank 0's tokens."""
    llm = LLM(str(checkpoint_dir("mixtral")), data_parallel_size=2, enable_elastic_recovery=True)
    engine = llm.llm_engine
    try:
        # Long enough not to finish before the kill: the tiny model decodes some 600 tokens/s
        # on a quiet machine, and a `step` with no request left returns at once without
        # reading the ranks, so a 300-token "a" that finished first left the death unseen.
        engine.add_request("a", "idle prompt", _greedy(2000), data_parallel_rank=1)
        engine.step()
        assert "a" in engine.requests, "the request finished before the kill"
        os.kill(engine._ranks[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not engine._ranks[1].joining:  # the failure is found and rank 1 started again
            assert time.monotonic() < deadline
            engine.step()
        # idle from here on: no step, no metrics poll
        deadline = time.monotonic() + 120
        while engine.rank_set.ranks[1].joining or engine.recovery.recovering:
            assert time.monotonic() < deadline, "the replacement was never taken in"
            time.sleep(0.2)
        new = engine.rank_set.ranks[1]
        assert new.ready_at is not None and new.mailbox is not None
        time.sleep(1.5)
        assert engine.__dict__.get("_watcher") is None  # the thread has exited
        metrics = llm.get_metrics()
        assert metrics["recoveries"] == 1 and not metrics["recovering"]
        assert metrics["ranks_joining"] == [] and metrics["ranks_retired"] == []
        assert metrics["recovery_seconds"] > 0
        for rank in (0, 1):
            engine.add_request(f"b{rank}", "same prompt", _greedy(12), data_parallel_rank=rank)
        got = {}
        deadline = time.monotonic() + 180
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            got.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
        assert set(got) == {"a", "b0", "b1"} and got["b0"] == got["b1"]
        assert len(got["a"]) == 2000
    finally:
        llm.shutdown()


def test_the_rule_restarts_within_budget_retires_otherwise_and_fails_with_none_left():
    """`ElasticRecovery.plan`: a group this frontend started, within the budget, restarts;
    one started elsewhere, or any once the budget is spent, is retired while another group is
    left; with none left the failure ends the job, saying why."""
    from batchgen.config import ParallelConfig
    from batchgen.distributed.rank_set import RankFailedError
    from batchgen.distributed.recovery import MAX_RECOVERIES, ElasticRecovery

    rec = ElasticRecovery(
        ParallelConfig(data_parallel_size=4, expert_parallel_size=2, enable_elastic_recovery=True)
    )
    died = RankFailedError("rank 3 died", [3], recoverable=True)
    local = lambda group: all(r < 2 for r in group)  # noqa: E731  (ranks 2, 3 from elsewhere)
    assert rec.plan(died, [[0, 1]], local, others_left=True) == ([0, 1], [])
    assert rec.plan(died, [[2, 3]], local, others_left=True) == ([], [2, 3])
    assert rec.plan(died, [[0, 1], [2, 3]], local, others_left=False) == ([0, 1], [2, 3])
    with pytest.raises(RankFailedError, match=r"ranks \[2, 3\] were started by torchrun.*no "):
        rec.plan(died, [[2, 3]], local, others_left=False)
    rec.recoveries = MAX_RECOVERIES
    assert rec.plan(died, [[0, 1]], local, others_left=True) == ([], [0, 1])
    with pytest.raises(RankFailedError, match="gave up after 3 restarts.*no other group") as e:
        rec.plan(died, [[0, 1]], local, others_left=False)
    assert e.value.__cause__ is died
    own_error = RankFailedError("rank 1 failed: ValueError", [1], recoverable=False)
    with pytest.raises(RankFailedError) as e:
        rec.plan(own_error, [[0, 1]], local, others_left=True)
    assert e.value is own_error  # a rank's own error is never outlived
    off = ElasticRecovery(ParallelConfig(data_parallel_size=2))
    with pytest.raises(RankFailedError) as e:
        off.plan(died, [[1]], local, others_left=True)
    assert e.value is died


def test_a_retired_rank_is_never_chosen_and_a_request_pinned_to_it_is_refused():
    """A rank retired for good takes no new request (least loaded or round robin), is no
    destination of a rebalancing move, and a request pinned to it fails with a ValueError
    naming it."""
    from test_rebalance import _add, _frontend

    from batchgen.distributed import protocol as msg

    for method in ("minimum_tokens", "round_robin"):
        client = _frontend(load_balance_method=method)
        client._ranks[1].retired = True
        for i in range(4):
            _add(client, f"a{i}", 50)
        assert {e.rank for e in client.requests.values()} == {0}
        with pytest.raises(ValueError, match="data_parallel_rank 1 was retired for good"):
            _add(client, "pinned", 50, rank=1)
        assert "pinned" not in client.requests
        client.rebalancer.plan()
        assert client.rank_set.taken(msg.Release) == []  # no move to the retired rank
        client._ranks[1].retired = False
        client.rebalancer.plan()
        assert [r for r, _ in client.rank_set.taken(msg.Release)] == [0]  # else one, to it
