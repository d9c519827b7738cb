"""`ModelRunner.prepare` (numpy over the step's decode rows) against a plain-Python reference of
the same layout: decode rows first, sorted by context (ties in scheduled order), then prefill
chunks; slot mapping, positions, sample indices, padded block tables per bucket, prefill spans'
K/V slots; unstaged (CPU) and staged (the CUDA path's host buffers) alike."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engine.host_staging import HostStaging
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.scheduler import ScheduledSeq
from batchgen.engine.sequence import Request, SequenceCoroutine
from batchgen.sampling_params import SamplingParams

BS, CACHE_BLOCKS = 4, 64
CPU = torch.device("cpu")


def _runner(in_place: bool, batch_invariant: bool, staged: bool) -> ModelRunner:
    """A runner without a model: only what `prepare` reads."""
    r = ModelRunner.__new__(ModelRunner)
    r.block_size, r.device = BS, CPU
    r.kv_caches = [(torch.empty(CACHE_BLOCKS * BS, 1, 1),)]
    r.staging = HostStaging(CPU, staged=staged, pin_memory=False)
    r.decode_backend, r.decode_in_place = "cpu_kernel", in_place
    r.batch_invariant, r.max_bucket_blocks = batch_invariant, 6
    return r


def _steps(rng: random.Random) -> list[ScheduledSeq]:
    """Decode rows (some tied contexts, one a prompt's last token, tables longer than needed)
    and prefill chunks (from 0 and from a later position, sampling or not), shuffled."""
    blocks = list(range(CACHE_BLOCKS))
    rng.shuffle(blocks)
    entries = []
    for i, (prompt, out, computed, new, extra) in enumerate([
        (5, 3, 7, 1, 0), (9, 0, 8, 1, 1), (3, 6, 8, 1, 0), (2, 1, 2, 1, 0), (6, 9, 14, 1, 0),
        (11, 0, 0, 6, 0), (10, 0, 4, 6, 0), (7, 0, 0, 7, 0), (5, 2, 6, 1, 2),
    ]):  # fmt: skip
        params = SamplingParams(max_tokens=20)
        req = Request(str(i), None, [rng.randrange(500) for _ in range(prompt)], params, i)
        outputs = [rng.randrange(500) for _ in range(out)]
        seq = SequenceCoroutine(i, req, 0, output_token_ids=outputs)
        need = -(-(computed + new) // BS) + extra
        seq.block_table = [blocks.pop() for _ in range(need)]
        seq.num_computed_tokens = computed
        req.seqs.append(seq)
        entries.append(ScheduledSeq(seq, new))
    rng.shuffle(entries)
    return entries


def _reference(runner: ModelRunner, scheduled: list[ScheduledSeq]):
    """The layout in plain Python (the engine's former list-building `prepare`)."""
    bs = runner.block_size
    decodes = sorted(
        (s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.seq.num_computed_tokens
    )
    ordered = decodes + [s for s in scheduled if s.num_new_tokens > 1]
    ids, pos, slots, samples, spans = [], [], [], [], []

    def slot(table, p):
        return table[p // bs] * bs + p % bs

    for e in ordered:
        seq, start = e.seq, e.seq.num_computed_tokens
        end = start + e.num_new_tokens
        first = len(ids)
        ids += seq.token_ids_slice(start, end)
        pos += range(start, end)
        slots += [slot(seq.block_table, p) for p in range(start, end)]
        if e.samples_next_token:
            samples.append(len(ids) - 1)
        if e.num_new_tokens > 1:
            kv_slots = [slot(seq.block_table, p) for p in range(end)]
            spans.append((first, e.num_new_tokens, end, kv_slots))
    kv_lens = [s.seq.num_computed_tokens + 1 for s in decodes]
    num_blocks = [-(-n // bs) for n in kv_lens]
    tables = [s.seq.block_table[:n] for s, n in zip(decodes, num_blocks)]
    return ordered, ids, pos, slots, samples, spans, kv_lens, num_blocks, tables


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize(
    ("in_place", "batch_invariant"), [(True, False), (False, False), (False, True)]
)
def test_prepare_matches_the_python_reference(in_place, batch_invariant, staged):
    rng = random.Random(7)
    for _ in range(5):
        runner = _runner(in_place, batch_invariant, staged)
        scheduled = _steps(rng)
        ordered, ids, pos, slots, samples, spans, kv_lens, nblk, tables = _reference(
            runner, scheduled
        )
        input_ids, meta, got_order, sample_indices = runner.prepare(scheduled)
        assert got_order == ordered
        assert input_ids.dtype == torch.long and input_ids.tolist() == ids
        assert meta.positions.tolist() == pos and meta.slot_mapping.tolist() == slots
        assert sample_indices.dtype == torch.long and sample_indices.tolist() == samples
        assert meta.num_decode_tokens == len(kv_lens) == 6
        got = [(p.token_start, p.num_tokens, p.kv_len, p.kv_slots.tolist()) for p in meta.prefills]
        assert got == spans
        buckets = meta.decode_buckets
        assert buckets[0].start == 0 and buckets[-1].end == len(kv_lens)
        if in_place:
            assert len(buckets) == 1
        if batch_invariant:
            assert [(b.start, b.end) for b in buckets] == [(i, i + 1) for i in range(len(kv_lens))]
        for b in buckets:
            width = nblk[b.end - 1]
            want = [t + [0] * (width - len(t)) for t in tables[b.start : b.end]]
            assert b.block_tables.dtype == torch.long and b.block_tables.tolist() == want
            assert b.kv_lens.tolist() == kv_lens[b.start : b.end]
            assert b.checked_num_blocks == CACHE_BLOCKS


def test_prepare_with_no_decode_rows_and_with_only_decode_rows():
    runner = _runner(True, False, False)
    scheduled = _steps(random.Random(3))
    prefills = [e for e in scheduled if e.num_new_tokens > 1]
    _, meta, _, _ = runner.prepare(prefills)
    assert meta.num_decode_tokens == 0 and meta.decode_buckets == []
    decodes = [e for e in scheduled if e.num_new_tokens == 1]
    ids, meta, _, samples = runner.prepare(decodes)
    assert meta.prefills == [] and ids.shape == (6,) and samples.tolist() == list(range(6))


def test_prepare_names_the_first_bad_decode_row():
    runner = _runner(True, False, False)
    scheduled = [e for e in _steps(random.Random(5)) if e.num_new_tokens == 1]
    ordered = sorted(scheduled, key=lambda e: e.seq.num_computed_tokens)
    last = [e.seq.num_computed_tokens // BS for e in ordered]  # each row's last block index
    ordered[3].seq.block_table[last[3]] = CACHE_BLOCKS  # outside the cache
    del ordered[4].seq.block_table[last[4] :]  # too short for its context
    ordered[5].seq.block_table[last[5] + 1 :] = [-1]  # past its context: never read, not checked
    with pytest.raises(ValueError, match=r"block_tables: decode row 3 holds a block id outside"):
        runner.prepare(scheduled)
    ordered[3].seq.block_table[last[3]] = 0
    with pytest.raises(ValueError, match=rf"block_tables: decode row 4 needs {last[4] + 1} blocks"):
        runner.prepare(scheduled)
    ordered[4].seq.block_table.append(1)
    runner.prepare(scheduled)
