"""Scheduler and KV block bookkeeping: pure Python, no model."""

from __future__ import annotations

import pytest

from batchgen.engine.block_manager import BlockAllocator, KVCacheManager
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Request, SequenceCoroutine, SequenceStatus
from batchgen.sampling_params import SamplingParams


def make_seqs(prompt_lens: list[int]) -> list[SequenceCoroutine]:
    seqs = []
    for i, n in enumerate(prompt_lens):
        req = Request(f"r{i}", None, list(range(1, n + 1)), SamplingParams(max_tokens=100), i)
        seq = SequenceCoroutine(i, req, 0)
        req.seqs.append(seq)
        seqs.append(seq)
    return seqs


def make_scheduler(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=16):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens), kv


def run_step(sched: Scheduler):
    """Apply a schedule as the engine would: advance computed tokens, append a token to
    sequences that reached their end."""
    out = sched.schedule()
    for e in out.scheduled:
        samples = e.samples_next_token
        e.seq.num_computed_tokens += e.num_new_tokens
        if samples:
            e.seq.output_token_ids.append(7)
    return out


def test_allocator_free_list_round_trip():
    alloc = BlockAllocator(3)
    got = alloc.allocate(2)
    assert got == [0, 1] and alloc.num_free_blocks == 1
    with pytest.raises(RuntimeError, match="only 1 free"):
        alloc.allocate(2)
    alloc.free(got)
    assert alloc.num_free_blocks == 3


def test_allocate_slots_grows_block_table_by_ceil():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    seq = make_seqs([5])[0]
    assert kv.allocate_slots(seq, 5) and len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    assert kv.allocate_slots(seq, 3) and len(seq.block_table) == 2  # positions 5..7 fit
    assert kv.allocate_slots(seq, 4) and len(seq.block_table) == 3
    assert not kv.allocate_slots(seq, 100)  # nothing allocated on failure
    assert len(seq.block_table) == 3 and kv.num_free_blocks == 1


def test_chunked_prefill_respects_token_budget():
    sched, _ = make_scheduler(num_blocks=32, max_num_batched_tokens=16)
    a, b = make_seqs([20, 10])
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 16)]
    out = run_step(sched)
    # a finishes its prompt (4 tokens, samples), b gets the remaining budget of 12 -> all 10
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 4), (1, 10)]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    out = run_step(sched)
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 1), (1, 1)]


def test_max_num_seqs_bounds_admission():
    sched, _ = make_scheduler(num_blocks=32, max_num_seqs=2)
    for s in make_seqs([2, 2, 2]):
        sched.add(s)
    out = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_preemption_frees_youngest_and_recomputes():
    # 4 blocks of 4 tokens; two sequences of 7 tokens take 2 blocks each; the first to grow
    # past 8 tokens forces the younger one out.
    sched, kv = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_seqs([7, 7])
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled (7 tokens computed), both sampled: 8 tokens each
    assert kv.num_free_blocks == 0
    assert not run_step(sched).preempted  # position 7 still fits in the 2nd block
    out = run_step(sched)  # a writes position 8: needs a 3rd block -> b preempted
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and sched.waiting[0] is b
    assert [e.seq for e in out.scheduled] == [a]


def test_lone_sequence_preempting_itself_is_retried_not_lost():
    sched, kv = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    (a,) = make_seqs([7])
    sched.add(a)
    run_step(sched)  # prefill: 7 computed, 8 tokens
    run_step(sched)  # position 7 computed, 9 tokens
    out = run_step(sched)  # position 8 needs a 3rd block; nothing else to evict
    assert out.preempted == [a] and not out.scheduled
    assert sched.waiting[0] is a


def test_no_starvation_every_sequence_progresses():
    sched, _ = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    seqs = make_seqs([9, 3, 5, 2, 11])
    for s in seqs:
        sched.add(s)
    for _ in range(400):
        out = run_step(sched)
        for s in seqs:
            if s.num_output_tokens >= 6 and not s.is_finished:
                sched.finish(s)
        sched.remove_finished()
        if all(s.is_finished for s in seqs):
            break
        assert out.scheduled or out.preempted
    assert all(s.is_finished for s in seqs)
    assert sched.kv_cache.num_free_blocks == 6


def make_request(prompt_len: int, n: int) -> list[SequenceCoroutine]:
    req = Request("r", None, list(range(1, prompt_len + 1)), SamplingParams(n=n, max_tokens=100), 0)
    req.seqs = [SequenceCoroutine(i, req, i) for i in range(n)]
    return req.seqs


def test_allocator_reference_counts():
    alloc = BlockAllocator(2)
    a, b = alloc.allocate(2)
    alloc.share([a])
    alloc.free([a, b])
    assert alloc.num_free_blocks == 1 and alloc.ref_count(a) == 1  # a still held once
    alloc.free([a])
    assert alloc.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="free"):
        alloc.share([a])
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([a])


def test_samples_share_the_prompt_blocks_and_copy_the_partial_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, 8, 64, enable_prefix_sharing=True)
    seqs = make_request(prompt_len=10, n=3)
    for s in seqs:
        sched.add(s)
    first = run_step(sched)
    # Only the first sample prefills; its siblings wait for it.
    assert [(e.seq.index, e.num_new_tokens) for e in first.scheduled] == [(0, 10)]
    assert [s.index for s in sched.waiting] == [1, 2]
    second = run_step(sched)
    new = {e.seq.index: e.num_new_tokens for e in second.scheduled}
    assert new == {0: 1, 1: 1, 2: 1}  # siblings compute only the last prompt token
    assert second.num_shared_prefix_tokens == 2 * 9
    leader = seqs[0].block_table
    for s in seqs[1:]:
        # Positions 0..7 (two whole blocks) shared; block 3 (positions 8, 9) copied.
        assert s.block_table[:2] == leader[:2] and s.block_table[2] != leader[2]
    assert second.block_copies == [
        (leader[2], seqs[1].block_table[2]),
        (leader[2], seqs[2].block_table[2]),
    ]
    assert kv.allocator.ref_count(leader[0]) == 3
    for s in seqs:
        sched.finish(s)
    assert kv.num_free_blocks == 16


def test_prefix_sharing_waits_for_blocks_and_lets_others_pass():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, 8, 64, enable_prefix_sharing=True)
    samples = make_request(prompt_len=8, n=2)
    other = make_seqs([3])[0]
    for s in [*samples, other]:
        sched.add(s)
    out = run_step(sched)
    # The second sample is deferred; the unrelated request behind it is admitted.
    assert [e.seq for e in out.scheduled] == [samples[0], other]
    assert list(sched.waiting) == [samples[1]]
    out = run_step(sched)
    # 7 = 1 whole block shared + 3 positions copied.
    assert samples[1].block_table[0] == samples[0].block_table[0]
    assert len(out.block_copies) == 1


def test_preempted_sample_shares_again_and_recomputes_its_outputs():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, 8, 64, enable_prefix_sharing=True)
    a, b = make_request(prompt_len=9, n=2)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    run_step(sched)
    run_step(sched)
    assert b.num_output_tokens == 2
    sched._preempt(sched.running.pop())  # b, the youngest
    assert b.block_table == [] and b.num_computed_tokens == 0
    out = run_step(sched)
    entry = next(e for e in out.scheduled if e.seq is b)
    # Prompt positions 0..7 shared (two whole blocks, no copy); the last prompt token and the
    # two outputs are recomputed.
    assert entry.num_new_tokens == 3 and out.block_copies == []
    assert b.block_table[:2] == a.block_table[:2]


def test_prefix_sharing_off_prefills_every_sample():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, 8, 64)
    for s in make_request(prompt_len=10, n=3):
        sched.add(s)
    out = run_step(sched)
    assert [e.num_new_tokens for e in out.scheduled] == [10, 10, 10]


def test_a_sequence_with_shipped_kv_is_admitted_as_a_decode_or_waits_for_blocks():
    """Straggler rebalancing ships a moved sample's K/V (``seq.kv_import``): admission
    allocates blocks for those positions plus the new token, schedules only what is left, and
    hands the sequence to the engine to write the K/V first; without room it stays waiting,
    K/V kept."""
    from batchgen.engine.migration import KVPayload

    sched, kv = make_scheduler(num_blocks=4, block_size=4)
    (hog,) = make_seqs([12])  # 3 of the 4 blocks
    sched.add(hog)
    run_step(sched)
    (moved,) = make_seqs([6])
    moved.output_token_ids = [9, 9, 9]  # 9 tokens, 8 of them computed on the source
    moved.kv_import = KVPayload(8, "float32", b"")
    sched.add(moved)
    out = sched.schedule()  # needs 3 blocks, 1 free: waits
    assert [e.seq for e in out.scheduled] == [hog] and not out.kv_imports
    assert moved.status is SequenceStatus.WAITING and moved.num_computed_tokens == 0
    assert moved.kv_import is not None and not moved.block_table
    sched.finish(hog)
    sched.remove_finished()
    out = sched.schedule()
    assert out.kv_imports == [moved] and len(moved.block_table) == 3
    ((entry,),) = [out.scheduled]
    assert entry.seq is moved and entry.num_new_tokens == 1 and entry.samples_next_token
    assert moved.num_computed_tokens == 8 and kv.num_free_blocks == 1
