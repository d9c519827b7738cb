"""The decode kernel's value checks (context lengths, block ids: `check_decode_context`) run
once per step and bucket, by the first layer, not once per layer; the shape checks still run on
every call, and a bad block table is still refused before the kernel reads memory."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import batchgen.models.layers.attention as attention
from batchgen.kernels.paged_attention import check_decode_context, paged_decode_attention
from batchgen.models.layers.attention import AttentionMetadata, DecodeBucket, paged_attention

BLOCK, BLOCKS, HQ, HKV, D = 4, 16, 4, 2, 8


@pytest.fixture(autouse=True)
def _kernel(monkeypatch):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "1")
    if not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here")


def _step(tables: list[list[int]], kv_lens: list[int]):
    g = torch.Generator().manual_seed(0)
    b = len(kv_lens)
    caches = [
        (torch.randn(BLOCKS * BLOCK, HKV, D, generator=g), torch.randn(BLOCKS * BLOCK, HKV, D))
        for _ in range(4)  # four layers
    ]
    bucket = DecodeBucket(0, b, torch.tensor(tables), torch.tensor(kv_lens))
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, kv_lens)]
    meta = AttentionMetadata(
        positions=torch.tensor([n - 1 for n in kv_lens]),
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=b,
        decode_buckets=[bucket],
        block_size=BLOCK,
    )
    q, k, v = torch.randn(b, HQ, D), torch.randn(b, HKV, D), torch.randn(b, HKV, D)
    return caches, meta, q, k, v


def test_checked_once_per_step_and_same_output(monkeypatch):
    calls = []
    real = attention.check_decode_context
    monkeypatch.setattr(
        attention, "check_decode_context", lambda *a: (calls.append(a), real(*a))[1]
    )
    caches, meta, q, k, v = _step([[3, 5], [7, 0]], [6, 3])
    outs = [paged_attention(q, k, v, kv, meta, D**-0.5) for kv in caches]
    assert len(calls) == 1  # four layers, one check
    # Each layer's output is what the kernel gives with its own checks on.
    bucket = meta.decode_buckets[0]
    for (kc, vc), out in zip(caches, outs):
        expect = torch.empty_like(q)
        paged_decode_attention(
            q, kc, vc, bucket.block_tables, bucket.kv_lens, BLOCK, D**-0.5, None, expect
        )
        assert torch.equal(out, expect)


def test_bad_block_id_is_refused_at_the_first_layer():
    caches, meta, q, k, v = _step([[BLOCKS + 2, 5], [7, 0]], [6, 3])  # a block read, not written
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(q, k, v, caches[0], meta, D**-0.5)
    with pytest.raises(ValueError, match="kv_lens"):
        check_decode_context(torch.tensor([[1]]), torch.tensor([BLOCK + 1]), BLOCK, BLOCKS)


def test_context_checked_still_checks_shapes_and_dtypes():
    caches, meta, q, _, _ = _step([[3, 5], [7, 0]], [6, 3])
    bucket = meta.decode_buckets[0]
    kc, vc = caches[0]
    with pytest.raises(ValueError, match="kv_lens"):
        bad = torch.tensor([6, 3, 1])  # one row too many
        out = torch.empty_like(q)
        args = (q, kc, vc, bucket.block_tables, bad, BLOCK, 1.0, None, out)
        paged_decode_attention(*args, context_checked=True)
    with pytest.raises(ValueError, match="int64"):
        out = torch.empty_like(q)
        args = (q, kc, vc, bucket.block_tables.int(), bucket.kv_lens, BLOCK, 1.0, None, out)
        paged_decode_attention(*args, context_checked=True)
