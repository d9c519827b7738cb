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
