"""Ranks that start at different speeds: one rank's start-up work (loading weights, the first
touch of its KV cache) can take longer than ``distributed_timeout_s`` beyond its peer's. That
timeout is for hangs once the ranks run; the start must not fail for it. Found as a flaky
`test_elastic_recovery` case: a 1 GiB KV cache backed by huge pages took one rank 4 s more
than the other in this VM (the test's timeout: 4 s), and the start failed at the all-to-all's
setup exchange ("Timed out waiting 4000ms") or named the loading rank stuck.

Every case carries a timeout; the LLM's ranks are stopped before it returns.
"""

from __future__ import annotations

import time

import psutil
import pytest
from rank_hooks import slow_model_load
from test_partial_recovery import _rank_set

from batchgen import LLM, SamplingParams
from batchgen.config import ParallelConfig
from batchgen.distributed.rank_set import RankFailedError

PROMPTS = ["the skewed start", "a second prompt, longer than the first one"]


@pytest.mark.timeout(240)
def test_a_rank_slower_to_start_than_the_timeout_does_not_fail_the_start(
    checkpoint_dir, tmp_path, monkeypatch
):
    slow_model_load(tmp_path, monkeypatch, 9, rank=1)
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


def _loading_group(waited_s: float, took_s: float):
    """Two ranks of one expert-parallel group: rank 0 loaded in ``took_s`` and has waited
    ``waited_s`` for rank 1, which still loads and heartbeats."""
    from batchgen.distributed import protocol as msg

    rank_set = _rank_set(2, 2)
    rank_set.parallel = ParallelConfig(
        data_parallel_size=2,
        expert_parallel_size=2,
        enable_elastic_recovery=True,
        distributed_timeout_s=4.0,
    )
    now = time.monotonic()
    first, slow = rank_set.ranks
    first.set_up_at = slow.set_up_at = now - waited_s - took_s
    first.phase, first.waiting_since = msg.WAITING_FOR_PEERS, now - waited_s
    slow.phase = "loading"
    return rank_set


@pytest.mark.parametrize(
    ("waited_s", "took_s", "named"),
    [
        (50.0, 10.0, False),  # within the 60 s floor
        (70.0, 10.0, True),  # past the floor; the first loaded fast
        (150.0, 200.0, False),  # a slow load: the laggard gets as long again
        (210.0, 200.0, True),
    ],
)
def test_a_rank_that_holds_up_its_groups_start_is_named(waited_s, took_s, named):
    """A rank that hangs while loading still heartbeats, so it is never silent; its peer
    waits in the group's first collective. It is named once its lag passes
    max(distributed_timeout_s, STARTING_SILENCE_S, the peer's own load time)."""
    rank_set = _loading_group(waited_s, took_s)
    if not named:
        assert rank_set._collect(timeout=0) == []
        return
    with pytest.raises(RankFailedError, match=r"rank 1 .* still loading \d+ s after rank 0") as e:
        rank_set._collect(timeout=0)
    assert e.value.ranks == [1]
    assert f"= {max(60.0, took_s):.0f} s" in str(e.value)


def test_a_rank_past_the_wait_or_in_another_group_is_not_named():
    from batchgen.distributed import protocol as msg

    rank_set = _loading_group(300.0, 10.0)
    rank_set.ranks[1].waiting_since = time.monotonic() - 1  # it reached the collective too
    assert rank_set._collect(timeout=0) == []
    rank_set = _loading_group(300.0, 10.0)
    rank_set.ranks[0].phase = "loading"  # the peer is past the collective: nobody waits
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


@pytest.mark.timeout(240)
def test_a_rank_that_hangs_while_loading_fails_the_start_naming_it(
    checkpoint_dir, tmp_path, monkeypatch
):
    """Rank 1 hangs in its model load (heartbeating all along); rank 0 loads and waits in
    the all-to-all's setup. The start fails within seconds of the bound (here lowered to
    5 s), naming rank 1, instead of after the rendezvous's 30 minutes; no rank is left."""
    import batchgen.distributed.rank_messages as rank_messages

    slow_model_load(tmp_path, monkeypatch, 3600, rank=1)
    monkeypatch.setattr(rank_messages, "STARTING_SILENCE_S", 5.0)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 .* still loading \d+ s after rank 0"):
        LLM(
            str(checkpoint_dir("mixtral")),
            data_parallel_size=2,
            enable_expert_parallel=True,
            distributed_timeout_s=4.0,
        )
    assert time.monotonic() - started < 120
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [
            p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        ]
        if not left:
            break
        time.sleep(0.5)
    assert not left, f"ranks left running: {left}"
