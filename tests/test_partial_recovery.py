"""Elastic recovery that keeps the survivors: a killed rank stops only its restart group (its
expert-parallel group, or itself when experts are replicated); that group starts again and
gets its unfinished requests back, while the other groups run on with theirs, in the same
processes. Every request is still answered exactly once with the tokens one process gives.

Every case carries a timeout and stops its rank processes before returning.
"""

from __future__ import annotations

import logging
import os
import re
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
    from batchgen.distributed.layout import resolve_layout
    from batchgen.distributed.rank_handle import RankHandle
    from batchgen.distributed.rank_join import Joining
    from batchgen.distributed.rank_set import RankSet

    rank_set = object.__new__(RankSet)
    rank_set.parallel = ParallelConfig(
        data_parallel_size=world, expert_parallel_size=ep, enable_elastic_recovery=True
    )
    rank_set.ranks = [RankHandle(r, _Conn(), "host", 100 + r) for r in range(world)]
    rank_set._inbox, rank_set._held = queue.Queue(), []
    rank_set.failure, rank_set.closed = None, False
    rank_set._joining = Joining(resolve_layout(rank_set.parallel))
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


class _HelloConn(_Conn):
    def __init__(self, hello) -> None:
        self.hello = hello

    def poll(self, timeout: float) -> bool:
        return True

    def recv(self):
        return self.hello


class _Proc:
    name, ended = "pid 7", False

    def done(self) -> bool:
        return self.ended

    def killed(self) -> bool:
        return True

    def describe(self) -> str:
        return "killed by SIGKILL"


def test_joining_ranks_are_set_up_by_whole_groups_and_a_death_before_connecting_fails():
    """`Joining.poll` never waits: it takes what connected, hands over a restart group only
    once all of its ranks connected, and reports a replacement that died before connecting."""
    import queue

    from batchgen.config import ParallelConfig
    from batchgen.distributed import protocol as msg
    from batchgen.distributed.layout import resolve_layout
    from batchgen.distributed.rank_join import Joining
    from batchgen.distributed.rank_set import RankFailedError

    layout = resolve_layout(ParallelConfig(data_parallel_size=4, expert_parallel_size=2))
    joining, arrived = Joining(layout), queue.Queue()
    procs = {r: _Proc() for r in (2, 3)}
    joining.add([2, 3], procs)
    address = ("127.0.0.1", 1)
    assert joining.active and joining.poll(arrived, 60, address) == []
    arrived.put((_HelloConn(msg.Hello(3, 13, "host", False, 5003)), "127.0.0.1"))
    arrived.put((_HelloConn(msg.Hello(0, 10, "host", False, 5000)), "127.0.0.1"))  # not asked
    assert joining.poll(arrived, 60, address) == []  # rank 2 is not in yet
    arrived.put((_HelloConn(msg.Hello(2, 12, "host", False, 5002)), "127.0.0.1"))
    (group,) = joining.poll(arrived, 60, address)
    assert sorted(group) == [2, 3] and group[2][0].pid == 12 and group[2][0].process is procs[2]
    assert not joining.active
    joining.add([2, 3], procs)
    procs[2].ended = True
    with pytest.raises(RankFailedError) as caught:
        joining.poll(arrived, 60, address)
    assert caught.value.ranks == [2] and caught.value.recoverable
    assert "before connecting" in str(caught.value)
    joining.drop([2, 3])
    assert not joining.active


def _rank0_tokens(i: int) -> int:
    """Staggered lengths (10, 30, ... 390 tokens) so that rank 0's outputs come back one by
    one over seconds, whatever the machine's speed, not all in one `step`."""
    return 10 + 20 * max(0, i - 4)


@pytest.mark.timeout(300)
def test_outputs_flow_from_the_survivor_while_the_replacement_starts(
    checkpoint_dir, tmp_path, monkeypatch
):
    """The frontend does not wait for a replacement: with rank 1's new process held back
    for 8 s before it even starts Python's site setup, rank 0's outputs are returned while
    rank 1 is still joining, then rank 1 takes its re-queued requests, and every request is
    answered once with one process's tokens."""
    prompts = [f"survivor prompt {i} " * (1 + i % 4) for i in range(24)]
    reference = LLM(str(checkpoint_dir("mixtral"))).generate(
        prompts, [_greedy(_rank0_tokens(i)) for i in range(24)], use_tqdm=False
    )
    llm = LLM(
        str(checkpoint_dir("mixtral")), data_parallel_size=2, enable_elastic_recovery=True
    )
    engine = llm.llm_engine
    try:
        # A replacement started from now on sleeps first (the first ranks are running).
        (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(8)\n")
        path = os.environ.get("PYTHONPATH")
        monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + path if path else ""))
        for i in range(4):  # rank 1's: still running when it is killed
            engine.add_request(f"r{i}", prompts[i], _greedy(200), data_parallel_rank=1)
        for i in range(4, 24):  # rank 0's: staggered, so they finish one by one
            engine.add_request(
                f"r{i}", prompts[i], _greedy(_rank0_tokens(i)), data_parallel_rank=0
            )
        deadline = time.monotonic() + 240
        got, while_joining = {}, []
        killed = False
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the job did not finish: a hang"
            outs = engine.step()
            if not killed and outs:
                os.kill(engine._ranks[1].pid, signal.SIGKILL)
                killed = True
            for out in outs:
                got[out.request_id] = out.outputs[0].token_ids
                if engine._ranks[1].joining:
                    while_joining.append(out.request_id)
        assert killed and while_joining, "no output came back while rank 1 was joining"
        assert all(int(i[1:]) >= 4 for i in while_joining)  # rank 0's
        assert not engine._ranks[1].joining
        for i in range(4):  # rank 1's requests ran again, with the tokens of max_tokens=200
            assert len(got[f"r{i}"]) == 200
        ref200 = LLM(str(checkpoint_dir("mixtral"))).generate(
            prompts[:4], _greedy(200), use_tqdm=False
        )
        assert [got[f"r{i}"] for i in range(4)] == [o.outputs[0].token_ids for o in ref200]
        assert {i: got[f"r{i}"] for i in range(4, 24)} == {
            i: reference[i].outputs[0].token_ids for i in range(4, 24)
        }
        metrics = llm.get_metrics()
        assert metrics["recoveries"] == 1 and metrics["requests_requeued"] == 4
        assert metrics["recovery_seconds"] >= 8
    finally:
        llm.shutdown()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("phase", ["starting", "loading"])
def test_shutdown_while_a_replacement_starts_does_not_wait_for_it(
    checkpoint_dir, tmp_path, monkeypatch, phase
):
    """`LLM.shutdown` while rank 1's replacement is still starting (held back before it
    connects) or loading (connected, set up, heartbeating, held back before the model loads)
    stops it at once (it has no results to wait for) and leaves no process behind."""
    llm = LLM(
        str(checkpoint_dir("mixtral")), data_parallel_size=2, enable_elastic_recovery=True
    )
    engine = llm.llm_engine
    try:
        _delay_new_ranks(tmp_path, monkeypatch, 60, while_loading=phase == "loading")
        # Long enough not to finish before the kill (a step with no request left does not
        # read the ranks, so a finished request would leave the death unseen).
        engine.add_request("a", "hello there", _greedy(2000), data_parallel_rank=1)
        engine.step()
        assert "a" in engine.requests, "the request finished before the kill"
        os.kill(engine._ranks[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60

        def there() -> bool:
            rank = engine._ranks[1]
            return rank.joining and (phase == "starting" or rank.mailbox is not None)

        while not there():
            assert time.monotonic() < deadline
            engine.step()
        if phase == "loading":
            time.sleep(1.0)  # it heartbeats while it loads: still joining
            engine.step()
            assert engine._ranks[1].joining
        processes = list(engine.rank_set._processes)  # every rank process started
        assert len(processes) == 3
        started = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - started < 5
        assert all(p.done() for p in processes)
    finally:
        llm.shutdown()


def test_a_replacement_not_connected_yet_is_never_named_stuck():
    """Rank 0 dies while rank 1's replacement has been starting for 10 s: the failure names
    rank 0 alone and stops only rank 0 (a placeholder has no heartbeat to be late with; its
    start is watched by `Joining`). It used to be named stuck, which restarted every rank."""
    from batchgen.distributed.mailbox import CLOSED
    from batchgen.distributed.rank_handle import RankHandle
    from batchgen.distributed.rank_set import RankFailedError

    rank_set = _rank_set(2, 1)
    joining = RankHandle(1, None, "", 0, joining=True)
    joining.last_seen -= 10
    rank_set.ranks[1] = joining
    rank_set._inbox.put((rank_set.ranks[0], CLOSED))
    with pytest.raises(RankFailedError) as caught:
        rank_set.receive(1.0)
    assert caught.value.ranks == [0] and caught.value.lost == [0]
    assert "rank 1" not in str(caught.value) and not joining.retired


def test_abort_while_a_failure_waits_for_recovery_reaches_the_running_rank():
    """A failure found by a metrics poll waits for the next `step`; an abort meanwhile still
    reaches a rank that runs on (it used to be dropped: the rank computed the request to the
    end and its load never went down)."""
    from test_rebalance import _add, _frontend

    from batchgen.distributed import protocol as msg
    from batchgen.distributed.rank_set import RankFailedError

    client = _frontend()
    _add(client, "a", 50, rank=0)
    client._flush(client._ranks[0])
    client.rank_set.failure = RankFailedError("rank 1 died", [1], recoverable=True)
    client.abort_request("a")
    assert client._ranks[0].load == 0
    aborts = client.rank_set.taken(msg.Abort)
    assert [(r, m.request_ids) for r, m in aborts] == [(0, ["a"])]


# A `sitecustomize` for rank processes: the first `configure_cpu_threads` call, which a rank
# makes once it has connected and been sent its setup, before it loads the model, sleeps.
_SLOW_LOADING = """
import importlib.machinery, sys, time


class _SlowLoading:
    def find_spec(self, name, path=None, target=None):
        if name != "batchgen.engine.cpu_threads":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real, slept = module.configure_cpu_threads, []

            def slow(*args, **kwargs):
                if not slept:
                    slept.append(True)
                    time.sleep(SECONDS)
                return real(*args, **kwargs)

            module.configure_cpu_threads = slow

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _SlowLoading())
"""


def _delay_new_ranks(tmp_path, monkeypatch, seconds: float, while_loading: bool = False) -> None:
    """Rank processes started from now on sleep ``seconds`` before Python's site setup, or,
    ``while_loading``, once connected and set up, before they load the model (heartbeating)."""
    code = _SLOW_LOADING if while_loading else "import time\ntime.sleep(SECONDS)\n"
    (tmp_path / "sitecustomize.py").write_text(code.replace("SECONDS", repr(seconds)))
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + path if path else ""))


def _run_killing(engine, kills, deadline_s: float = 240) -> dict:
    """Step until done; ``kills``: (condition(engine) -> bool, action(engine)) pairs, each
    done once, in order, when its condition first holds after a step."""
    got, kills = {}, list(kills)
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the job did not finish: a hang"
        for out in engine.step():
            assert out.request_id not in got, f"{out.request_id} answered twice"
            got[out.request_id] = out.outputs[0].token_ids
        if kills and kills[0][0](engine):
            kills.pop(0)[1](engine)
    assert not kills, "a planned kill never happened"
    return got


@pytest.mark.timeout(400)
@pytest.mark.parametrize("second", ["replacement", "survivor"])
def test_a_second_kill_while_a_replacement_joins(checkpoint_dir, tmp_path, monkeypatch, second):
    """Rank 1 is killed with requests on it; while its replacement is still starting (held
    back 5 s), either the replacement itself is killed before it connects, or the survivor,
    rank 0, with new requests on it, after the replacement has been starting for over 3 s
    (it must not be named stuck). Both are one more recovery; every request is answered once
    with one process's tokens."""
    path = str(checkpoint_dir("mixtral"))
    prompts = [f"second kill prompt {i} " * (1 + i % 3) for i in range(8)]
    params = _greedy(160)
    want = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, data_parallel_size=2, enable_elastic_recovery=True)
    engine = llm.llm_engine
    try:
        _delay_new_ranks(tmp_path, monkeypatch, 5)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params, data_parallel_rank=i % 2)
        for rank in engine._ranks:
            engine._flush(rank)
        os.kill(engine._ranks[1].pid, signal.SIGKILL)  # its requests are unfinished
        expected = {f"r{i}": want[i] for i in range(8)}
        joining_since = {}

        def joining_long(e) -> bool:
            if e._ranks[1].joining:
                joining_since.setdefault("t", time.monotonic())
            return time.monotonic() - joining_since.get("t", time.monotonic()) > 3.5

        def kill_busy_survivor(e) -> None:
            for i in range(4):  # work that rank 0 holds when it dies
                e.add_request(f"x{i}", prompts[i], params, data_parallel_rank=0)
                expected[f"x{i}"] = want[i]
            e._flush(e._ranks[0])
            os.kill(e._ranks[0].pid, signal.SIGKILL)

        if second == "replacement":
            then = (lambda e: e._ranks[1].joining, lambda e: e._ranks[1].process.kill())
        else:
            then = (joining_long, kill_busy_survivor)
        got = _run_killing(engine, [then])
        assert got == expected
        assert llm.get_metrics()["recoveries"] == 2
    finally:
        llm.shutdown()


@pytest.mark.parametrize("peer", ["stopped", "alive"])
def test_a_collective_timeout_waits_to_tell_a_stuck_peer_from_an_alive_one(peer):
    """Rank 1 reports gloo's timeout while rank 0's last heartbeat is 2 s old, not yet late
    enough to call it stuck (3 s). The set waits: a stopped rank 0 is then named stuck (a
    recoverable failure: it used to be rank 1's own error, which ends the job); an alive one
    heartbeats, and rank 1's report is its own error."""
    import threading

    from batchgen.distributed import protocol as msg
    from batchgen.distributed.rank_set import RankFailedError

    rank_set = _rank_set(2, 2)
    r = rank_set.ranks
    r[0].last_seen = time.monotonic() - 2.0  # rank 1 was just heard from (its report)
    done = threading.Event()

    def heartbeats() -> None:  # an alive rank 0, as its mailbox would note them
        while not done.wait(0.5):
            r[0].note(msg.Heartbeat(0, 9, "step"))

    if peer == "alive":
        threading.Thread(target=heartbeats, daemon=True).start()
    rank_set.shutdown = lambda *a, **k: None  # an error that ends the job stops every rank
    rank_set._inbox.put((r[1], msg.Failed(1, "RuntimeError: Timed out waiting 4000ms for send")))
    with pytest.raises(RankFailedError) as caught:
        rank_set.receive(1.0)
    done.set()
    failure = caught.value
    if peer == "stopped":
        assert failure.ranks == [0] and failure.recoverable, str(failure)
        assert "rank 0" in str(failure) and "silent" in str(failure)
    else:
        assert failure.ranks == [1] and not failure.recoverable, str(failure)


def test_requests_go_to_ready_ranks_while_a_replacement_joins():
    """While rank 1 is started again, new and re-queued requests go to rank 0 (least loaded or
    round robin alike); a request pinned to rank 1 waits for it; once rank 1 is ready it takes
    new work again. With every rank joining, requests are still queued."""
    from test_rebalance import _add, _frontend

    for method in ("minimum_tokens", "round_robin"):
        client = _frontend(load_balance_method=method)
        client._ranks[1].joining = True
        for i in range(3):
            _add(client, f"a{i}", 50)
        _add(client, "pinned", 50, rank=1)
        assert {i: e.rank for i, e in client.requests.items()} == {
            "a0": 0,
            "a1": 0,
            "a2": 0,
            "pinned": 1,
        }
        assert [p[0] for p in client._ranks[1].pending] == ["pinned"]
        client._ranks[1].joining = False  # ready: the least loaded, or next in turn
        _add(client, "b0", 50)
        _add(client, "b1", 50)
        assert 1 in {client.requests["b0"].rank, client.requests["b1"].rank}
        client._ranks[0].joining = client._ranks[1].joining = True
        _add(client, "c0", 50)
        assert client.requests["c0"].rank in (0, 1)


def test_the_rebalancer_moves_nothing_to_a_joining_rank_and_fills_it_once_ready():
    from batchgen.distributed.rebalance import Candidate, Move, plan_moves

    candidates = [Candidate(f"w{i}", 0, 100, 0) for i in range(4)]
    assert plan_moves([400.0, 0.0], [None, None], candidates, joining={1}) == []
    assert plan_moves([400.0, 0.0], [None, None], candidates) == [
        Move("w0", 0, 1),
        Move("w1", 0, 1),
    ]
    # three ranks, 2 joining: the moves go to rank 1 only
    three = plan_moves([400.0, 0.0, 0.0], [None] * 3, candidates, joining={2})
    assert three and all(m.dst == 1 for m in three)


def test_recovery_metrics_are_live_and_end_when_the_ready_arrived(monkeypatch):
    """Under way, a recovery shows in the metrics (recovering, the ranks joining, the
    requests re-queued so far, the seconds so far); it ends at the time the last new rank's
    `Ready` arrived, not when the frontend read it."""
    from batchgen.config import ParallelConfig
    from batchgen.distributed import recovery
    from batchgen.distributed.rank_set import RankFailedError

    clock = [100.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: clock[0])
    rec = recovery.ElasticRecovery(
        ParallelConfig(data_parallel_size=2, enable_elastic_recovery=True)
    )
    rec.begin(RankFailedError("rank 1 died", [1], recoverable=True), [], 0, 3, [1])
    rec.requeue(["a", "b", "c"], [1])
    clock[0] = 104.0
    live = rec.metrics([1])
    assert live["recovering"] and live["ranks_joining"] == [1]
    assert (live["requests_requeued"], live["recovery_seconds"]) == (3, 4.0)
    rec.requeue(["a", "b"], [1])  # a failed restart re-queues the same requests: once
    clock[0] = 130.0  # the frontend reads the Ready late (an idle engine)
    rec.end(1, ready_at=106.5)
    done = rec.metrics()
    assert not done["recovering"] and done["ranks_joining"] == []
    assert (done["requests_requeued"], done["recovery_seconds"]) == (3, 6.5)
    assert done["recoveries"] == 1


@pytest.mark.timeout(300)
def test_requeued_requests_run_on_the_survivor_while_the_replacement_loads(
    checkpoint_dir, reference, tmp_path, monkeypatch
):
    """Rank 1 is killed with requests on it and its replacement is held back 8 s: its
    re-queued requests go to rank 0 and are all answered before the replacement is ready
    (they used to wait for it). Meanwhile the metrics show the recovery under way, the
    placeholder carries the replacement's pid, and an abort of a request pinned to the
    joining rank drops it there. On the idle engine, metrics polls take the replacement in;
    the recovery ends at its Ready, and rank 1 then takes new work. Every request is answered
    once with one process's tokens."""
    llm = LLM(
        str(checkpoint_dir("mixtral")), data_parallel_size=2, enable_elastic_recovery=True
    )
    engine = llm.llm_engine
    prompts = _prompts(12)
    try:
        _delay_new_ranks(tmp_path, monkeypatch, 8)
        for i in range(8):
            engine.add_request(f"r{i}", prompts[i], _greedy(24))
        for rank in engine._ranks:
            engine._flush(rank)
        held = {i for i, e in engine.requests.items() if e.rank == 1}
        old_pid = engine._ranks[1].pid
        killed_at = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)

        def while_joining(e) -> bool:
            return e._ranks[1].joining

        def look_and_abort(e) -> None:
            live = e.live_metrics()
            assert live["recovering"] and live["ranks_joining"] == [1], live
            assert live["requests_requeued"] >= 1 and live["recovery_seconds"] > 0, live
            placeholder = e._ranks[1]
            assert placeholder.pid == placeholder.process.pid not in (0, old_pid)
            assert all(e.requests[i].rank == 0 for i in held if i in e.requests)
            e.add_request("pinned", prompts[0], _greedy(24), data_parallel_rank=1)
            e.abort_request("pinned")
            assert placeholder.pending == [] and placeholder.load == 0

        got = _run_killing(engine, [(while_joining, look_and_abort)], deadline_s=120)
        assert engine._ranks[1].joining, "the re-queued requests waited for the replacement"
        assert got == {f"r{i}": reference[f"r{i}"] for i in range(8)}
        deadline = time.monotonic() + 120
        while llm.llm_engine.live_metrics()["ranks_joining"]:  # idle: polls take it in
            assert time.monotonic() < deadline, "the replacement never became ready"
            time.sleep(0.2)
        seen_ready = time.monotonic()
        metrics = llm.get_metrics()
        assert not metrics["recovering"] and metrics["recoveries"] == 1
        assert 1 <= metrics["requests_requeued"] <= len(held)
        assert 8 <= metrics["recovery_seconds"] <= seen_ready - killed_at
        time.sleep(1.0)
        assert llm.get_metrics()["recovery_seconds"] == metrics["recovery_seconds"]
        for i in range(8, 12):  # new work reaches the replacement
            engine.add_request(f"r{i}", prompts[i], _greedy(24))
        assert 1 in {engine.requests[f"r{i}"].rank for i in range(8, 12)}
        more = _run_killing(engine, [], deadline_s=120)
        assert more == {f"r{i}": reference[f"r{i}"] for i in range(8, 12)}
        assert "pinned" not in got and "pinned" not in more
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_killing_each_replacement_spends_the_restart_budget_then_retires_the_rank(
    checkpoint_dir, tmp_path, monkeypatch
):
    """Rank 1 killed, then each of its replacements before it connects: three recoveries
    (`MAX_RECOVERIES`); the fourth failure retires rank 1 for good, since rank 0 runs: the
    request pinned to rank 1 fails with an error naming it, rank 0's finishes. Then rank 0 is
    killed: no group is left, so the job ends with an error that says so; every later call
    raises it again and no rank process is left."""
    from batchgen.distributed.rank_set import RankFailedError
    from batchgen.distributed.recovery import MAX_RECOVERIES

    assert MAX_RECOVERIES == 3
    llm = LLM(
        str(checkpoint_dir("mixtral")), data_parallel_size=2, enable_elastic_recovery=True
    )
    engine = llm.llm_engine
    try:
        _delay_new_ranks(tmp_path, monkeypatch, 60)  # a replacement never connects by itself
        # "one" is long enough not to finish before the kill (a finished one would leave
        # nothing on rank 1 to fail).
        engine.add_request("one", "on rank one", _greedy(2000), data_parallel_rank=1)
        engine.add_request("zero", "on rank zero", _greedy(60), data_parallel_rank=0)
        outs = {o.request_id: o for o in engine.step()}
        assert "one" in engine.requests, "the request finished before the kill"
        processes = list(engine.rank_set._processes)
        os.kill(engine._ranks[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        killed = 0
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the job did not go on: a hang"
            outs.update({o.request_id: o for o in engine.step()})
            rank = engine._ranks[1]
            if rank.joining and rank.process is not None and not rank.process.done():
                processes.append(rank.process)
                rank.process.kill()
                killed += 1
        assert killed == 3 and engine.recovery.recoveries == 3
        assert engine._ranks[1].retired and engine.recovery.ranks_retired == [1]
        assert outs["one"].error is not None and outs["one"].outputs == []
        assert "data_parallel_rank 1 was retired" in outs["one"].error
        assert "restart budget is spent" in outs["one"].error
        assert outs["zero"].error is None and len(outs["zero"].outputs[0].token_ids) == 60
        engine.add_request("last", "on rank zero", _greedy(2000))
        engine.step()
        assert "last" in engine.requests, "the request finished before the kill"
        os.kill(engine._ranks[0].pid, signal.SIGKILL)
        with pytest.raises(RankFailedError) as info:
            while True:
                assert time.monotonic() < deadline, "the job did not end: a hang"
                engine.step()
        failure = info.value
        pattern = r"rank 0 .*SIGKILL.*gave up after 3 restarts.*no other group is left"
        assert re.search(pattern, str(failure)), str(failure)
        for call in (engine.step, llm.get_metrics, lambda: engine.add_request("x", "y")):
            with pytest.raises(RankFailedError) as again:
                call()
            assert again.value is failure
        assert all(p.wait(10) for p in processes)  # rank 0 too: the job ended
    finally:
        llm.shutdown()


def test_a_move_to_a_rank_that_restarted_meanwhile_lands_on_a_ready_rank():
    """A rebalancing move planned to rank 1 is released by rank 0 after rank 1 was stopped
    and started again: the request goes to a ready rank (here back to rank 0, with its
    progress), not into the starting rank's queue."""
    from test_rebalance import _add, _frontend, _state

    from batchgen.distributed import protocol as msg

    client = _frontend()
    client._ranks[1].joining = True  # both requests go to rank 0
    _add(client, "w0", 200)
    _add(client, "w1", 200)
    client._ranks[1].joining = False  # ready: the next round moves one to it
    report = [("w0", 150, 20, True), ("w1", 204, 0, False)]
    client._dispatch([(client._ranks[0], msg.Load(0, 1, report, 10_000))])
    ((src, release),) = client.rank_set.taken(msg.Release)
    assert src == 0 and len(release.request_ids) == 1
    assert [r for r, _ in client.rank_set.taken(msg.AddRequests)] == [0]  # the first send
    moved = release.request_ids[0]
    client._ranks[1].joining = True  # stopped and started again meanwhile
    states = {moved: _state(started=True)}
    client._dispatch([(client._ranks[0], msg.Released(0, release.token, states, 10))])
    assert client.requests[moved].rank == 0 and client._ranks[1].pending == []
    ((dst, add),) = client.rank_set.taken(msg.AddRequests)
    assert dst == 0 and [(r[0], r[4]) for r in add.requests] == [(moved, states[moved])]
