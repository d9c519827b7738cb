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
import signal
import subprocess
import sys
import time

import psutil
import pytest
from dist_helpers import free_port
from rank_hooks import assert_no_ranks_left, slow_rank_start
from test_partial_recovery import _rank_set

from batchgen import LLM, SamplingParams
from batchgen.config import ParallelConfig
from batchgen.distributed.rank_set import RankFailedError

PROMPTS = ["the skewed start", "a second prompt, longer than the first one"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("at", ["load", "after_transport"])
def test_a_rank_slower_to_start_than_the_timeout_does_not_fail_the_start(
    checkpoint_dir, tmp_path, monkeypatch, at
):
    """Rank 1 starts 9 s late against a 4 s timeout: in its model load (its peer waits in the
    all-to-all's setup), or after the all-to-all's setup (its peer has loaded: it waits for
    rank 1 before its first control exchange, whose timeout is the 4 s, not in it)."""
    slow_rank_start(tmp_path, monkeypatch, 9, rank=1, at=at)
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
    monkeypatch.delenv("BATCHGEN_TEST_SLOW_LOAD_S")
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


def _beat(handle, *phases: str) -> None:
    """``handle`` hears heartbeats with ``phases``, in order (as its mailbox would)."""
    from batchgen.distributed import protocol as msg

    for phase in phases:
        handle.note(msg.Heartbeat(handle.rank, 0, phase))


def _loading_group(waited_s: float, took_s: float, wait: int = 2):
    """Two ranks of one expert-parallel group: rank 0 reached its ``wait``-th wait for its
    group ``took_s`` after its setup (1: the rendezvous, 2: the all-to-all's setup, 3: the end
    of its start) and has waited there ``waited_s`` for rank 1, which passed the waits before
    with it and still loads, heartbeating."""
    from batchgen.distributed import protocol as msg

    rank_set = _rank_set(2, 2)
    rank_set.parallel = ParallelConfig(
        data_parallel_size=2,
        expert_parallel_size=2,
        enable_elastic_recovery=True,
        distributed_timeout_s=4.0,
    )
    first, slow = rank_set.ranks
    for _ in range(wait - 1):
        _beat(first, msg.WAITING_FOR_PEERS, "loading")
        _beat(slow, msg.WAITING_FOR_PEERS, "loading")
    _beat(first, msg.WAITING_FOR_PEERS)
    assert (first.waits, slow.waits) == (wait, wait - 1)
    now = time.monotonic()
    first.set_up_at = slow.set_up_at = now - waited_s - took_s
    first.waiting_since = now - waited_s
    return rank_set


@pytest.mark.parametrize("wait", [1, 2, 3])
@pytest.mark.parametrize(
    ("waited_s", "took_s", "named"),
    [
        (50.0, 10.0, False),  # within the 60 s floor
        (70.0, 10.0, True),  # past the floor; the first loaded fast
        (150.0, 200.0, False),  # a slow load: the laggard gets as long again
        (210.0, 200.0, True),
    ],
)
def test_a_rank_that_holds_up_its_groups_start_is_named(waited_s, took_s, named, wait):
    """A rank that hangs while it starts still heartbeats, so it is never silent; its peer
    waits for it (at the rendezvous, the all-to-all's setup or the end of its start). It is
    named once its lag passes max(distributed_timeout_s, STARTING_SILENCE_S, the time the
    peer took to get there)."""
    rank_set = _loading_group(waited_s, took_s, wait)
    if not named:
        assert rank_set._collect(timeout=0) == []
        return
    phase = "starting" if wait == 1 else "loading"  # its phase before its first wait
    with pytest.raises(RankFailedError, match=rf"rank 1 .* still {phase} \d+ s after rank 0") as e:
        rank_set._collect(timeout=0)
    assert e.value.ranks == [1] and e.value.recoverable
    assert f"{took_s:.0f} s into its start" in str(e.value)
    assert f"= {max(60.0, took_s):.0f} s" in str(e.value)


def test_a_rank_past_the_wait_or_in_another_group_is_not_named():
    from batchgen.distributed import protocol as msg

    rank_set = _loading_group(300.0, 10.0)
    _beat(rank_set.ranks[1], msg.WAITING_FOR_PEERS)  # it reached the collective too
    assert rank_set._collect(timeout=0) == []
    rank_set = _loading_group(300.0, 10.0)
    _beat(rank_set.ranks[0], "loading")  # the peer is past the collective: nobody waits
    assert rank_set._collect(timeout=0) == []
    rank_set = _loading_group(300.0, 10.0)
    rank_set.parallel = ParallelConfig(
        data_parallel_size=2, expert_parallel_size=1, distributed_timeout_s=4.0
    )
    rank_set._joining.layout = __import__(
        "batchgen.distributed.layout", fromlist=["resolve_layout"]
    ).resolve_layout(rank_set.parallel)  # replicated experts: no group waits for rank 1
    assert rank_set.ranks[0].phase == msg.WAITING_FOR_PEERS
    assert rank_set._collect(timeout=0) == []


def _started_together(world: int, ep: int, ready: list[int], waited_s: float):
    """``world`` ranks set up together 10 s + ``waited_s`` ago; ``ready`` have been ready
    for ``waited_s`` (they took 10 s), the others still load, heartbeating."""
    rank_set = _rank_set(world, ep)
    rank_set.parallel = ParallelConfig(
        data_parallel_size=world,
        expert_parallel_size=ep,
        enable_elastic_recovery=True,
        distributed_timeout_s=4.0,
    )
    now = time.monotonic()
    for rank in rank_set.ranks:
        rank.set_up_at = now - waited_s - 10.0
        _beat(rank, "loading")
        if rank.rank in ready:
            rank.ready_at = now - waited_s
    return rank_set


@pytest.mark.parametrize(
    ("world", "ep", "ready", "late"),
    [
        (2, 1, [0], [1]),  # replicated experts: no collective waits for rank 1
        (4, 1, [0, 2, 3], [1]),
        (4, 2, [0, 1], [2, 3]),  # a whole group hangs: nobody of its group waits
    ],
)
def test_a_rank_that_lags_the_first_ready_rank_of_its_start_is_named(world, ep, ready, late):
    """The frontend waits for every rank's `Ready`: a rank that nobody of its group waits for
    in a collective (experts replicated, or its whole group hangs) held the start for ever.
    It is named once the first rank ready of those set up with it has been ready longer than
    max(distributed_timeout_s, STARTING_SILENCE_S, that rank's time to get ready)."""
    assert _started_together(world, ep, ready, waited_s=50.0)._collect(timeout=0) == []
    rank_set = _started_together(world, ep, ready, waited_s=70.0)
    with pytest.raises(RankFailedError, match=r"still loading 70 s after rank 0 was ready") as e:
        rank_set._collect(timeout=0)
    assert e.value.ranks == late and e.value.recoverable
    assert "10 s into its start" in str(e.value) and "= 60 s" in str(e.value)


def test_a_rank_started_again_is_not_held_against_ranks_ready_before():
    """Elastic recovery: ranks 2 and 3 started again 30 s ago load while ranks 0 and 1 have
    been ready for an hour; only ranks set up together are compared."""
    rank_set = _started_together(4, 2, [0, 1], waited_s=3600.0)
    for rank in rank_set.ranks[2:]:
        rank.set_up_at = time.monotonic() - 30.0
    assert rank_set._collect(timeout=0) == []


def test_ranks_started_again_that_all_hang_are_named_after_the_last_start():
    """Every rank of a start hangs while loading (a restart after a failure, the model on a
    stalled file system): nobody is ahead of them. With an earlier start of every rank to go
    by (`RankSet.start_took`, here 10 s) they are named once they lag it by the bound; the
    first start of a job has nothing to go by and waits."""
    assert _started_together(2, 2, [], waited_s=70.0)._collect(timeout=0) == []
    rank_set = _started_together(2, 2, [], waited_s=50.0)
    rank_set.start_took = 10.0
    assert rank_set._collect(timeout=0) == []
    rank_set = _started_together(2, 2, [], waited_s=70.0)
    rank_set.start_took = 10.0
    pattern = r"rank 0 .* still loading 70 s longer than the job's last start took \(10 s\)"
    with pytest.raises(RankFailedError, match=pattern) as e:
        rank_set._collect(timeout=0)
    assert e.value.ranks == [0, 1] and e.value.recoverable and "= 60 s" in str(e.value)


def test_a_rank_one_wait_behind_is_named_though_it_waited_before():
    """The start has several waits for the group (the rendezvous, the all-to-all's setup, the
    end of the start): a rank that waited at an earlier one and now hangs in its load is
    still named when its peer waits at the next one; a rank at the same wait is not. Each
    `WAITING_FOR_PEERS` heartbeat after another phase begins a new wait; the heartbeats that
    repeat it do not."""
    from batchgen.distributed import protocol as msg

    rank_set = _loading_group(300.0, 10.0, wait=3)
    first, slow = rank_set.ranks
    _beat(first, msg.WAITING_FOR_PEERS, msg.WAITING_FOR_PEERS)  # beats within one wait
    assert (first.waits, slow.waits) == (3, 2)
    with pytest.raises(RankFailedError, match=r"rank 1 .* still loading \d+ s after rank 0"):
        rank_set._collect(timeout=0)
    rank_set = _loading_group(300.0, 10.0, wait=3)
    _beat(rank_set.ranks[1], msg.WAITING_FOR_PEERS)
    assert rank_set._collect(timeout=0) == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("at", "phase", "expert_parallel"),
    [
        ("load", "loading", True),
        ("after_transport", "loading", True),
        ("before_join", "starting", True),
        ("load", "loading", False),
    ],
)
def test_a_rank_that_hangs_while_loading_fails_the_start_naming_it(
    checkpoint_dir, tmp_path, monkeypatch, at, phase, expert_parallel
):
    """Rank 1 hangs while it starts (heartbeating all along): in its model load (rank 0
    waits in the all-to-all's setup), after the all-to-all's setup (rank 0 waits for it
    before its first control exchange; before, rank 0's exchange timed out and rank 0 was
    named, with no recovery), or before the rendezvous (rank 0 waits there; before, for the
    rendezvous's 30 minutes); or, with replicated experts, in its model load while rank 0 is
    ready (nobody waits in a collective, the frontend waits for its `Ready`: before, for
    ever). The start fails within seconds of the bound (here lowered to 5 s), naming rank 1
    as recoverable; no rank is left."""
    import batchgen.distributed.rank_messages as rank_messages

    slow_rank_start(tmp_path, monkeypatch, 3600, rank=1, at=at)
    monkeypatch.setattr(rank_messages, "STARTING_SILENCE_S", 5.0)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    pattern = rf"rank 1 .* still {phase} \d+ s after rank 0 .* stuck, or too slow, while starting"
    with pytest.raises(RankFailedError, match=pattern) as caught:
        LLM(
            str(checkpoint_dir("mixtral")),
            data_parallel_size=2,
            enable_expert_parallel=expert_parallel,
            distributed_timeout_s=4.0,
        )
    assert time.monotonic() - started < 120
    assert caught.value.ranks == [1] and caught.value.recoverable
    assert_no_ranks_left(before)


@pytest.mark.timeout(240)
def test_ranks_from_another_machine_leave_once_their_frontend_gives_up(
    checkpoint_dir, tmp_path, monkeypatch
):
    """Both ranks come from another machine's launcher (``data_parallel_size_local=0``) and
    rank 1 hangs in its model load. The frontend names rank 1 and gives up, but it cannot
    kill ranks it did not start: rank 0 waits in the all-to-all's setup (the rendezvous's 30
    minutes) and rank 1 hangs. Both leave within `FRONTEND_GONE_GRACE_S` of finding their
    frontend gone (or at the end of the first to leave), so the launcher ends (exit code 1)
    instead of holding the machine."""
    import batchgen.distributed.rank_messages as rank_messages
    from batchgen.distributed.rank_link import FRONTEND_GONE_GRACE_S

    slow_rank_start(tmp_path, monkeypatch, 3600, rank=1)
    monkeypatch.setattr(rank_messages, "STARTING_SILENCE_S", 5.0)
    monkeypatch.setenv("BATCHGEN_DP_AUTHKEY", "test-secret")
    port = free_port()
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgen.distributed.launch",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(port),
            "--data-parallel-size-local",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "ranks.log", "w"),
        start_new_session=True,  # its own process group: killed whole below, whatever happens
    )
    try:
        with pytest.raises(RankFailedError, match=r"rank 1 .* still loading \d+ s after rank 0"):
            LLM(
                str(checkpoint_dir("mixtral")),
                data_parallel_size=2,
                data_parallel_size_local=0,
                data_parallel_address="127.0.0.1",
                data_parallel_rpc_port=port,
                enable_expert_parallel=True,
                distributed_timeout_s=4.0,
            )
        gave_up = time.monotonic()
        try:
            code = launcher.wait(timeout=FRONTEND_GONE_GRACE_S + 30)
        except subprocess.TimeoutExpired:
            code = None
        log = (tmp_path / "ranks.log").read_text()
        assert code == 1, f"the ranks outlived their frontend:\n{log[-3000:]}"
        assert time.monotonic() - gave_up < FRONTEND_GONE_GRACE_S + 30
        # the first to end (either) closes its collective's connection: the other may fail
        # out of its wait on that before its own grace is over
        assert "the frontend is gone" in log, log[-3000:]
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait(timeout=30)
