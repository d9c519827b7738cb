"""Paged decode attention: block-granular gathers and length buckets against a plain
per-sequence softmax attention over the same K/V."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from batchgen.kernels.paged_attention import decode_kernel_available
from batchgen.models.layers.attention import (
    AttentionMetadata,
    DecodeBucket,
    paged_attention,
    plan_decode_buckets,
)


def test_plan_decode_buckets_bounds_padding():
    counts = [1, 1, 2, 3, 3, 4, 7, 9, 20, 20, 21]
    buckets = plan_decode_buckets(counts)
    assert buckets == [(0, 3), (3, 6), (6, 8), (8, 11)]
    # Contiguous, covering, and each bucket's max <= 1.5 * min + 1.
    assert [b[0] for b in buckets[1:]] == [b[1] for b in buckets[:-1]]
    for start, end in buckets:
        assert counts[end - 1] <= counts[start] * 1.5 + 1
    assert plan_decode_buckets([]) == []
    assert plan_decode_buckets([5]) == [(0, 1)]


def test_plan_decode_buckets_bounds_gathered_blocks():
    counts = [4] * 10 + [5] * 3 + [40]
    buckets = plan_decode_buckets(counts, max_bucket_blocks=16)
    # 4 rows of 4 blocks fit in 16; 2 of 4 and 1 of 5 gather 3 x 5 = 15 blocks (padded to the
    # widest); a row of 40 stands alone.
    assert buckets == [(0, 4), (4, 8), (8, 11), (11, 13), (13, 14)]
    for start, end in buckets:
        assert (end - start) * counts[end - 1] <= 16 or end - start == 1


def _reference(q, k_seq, v_seq, scale, window):
    """One query ``[Hq, D]`` over ``k_seq, v_seq [L, Hkv, D]`` (query at position L - 1)."""
    hq, hkv = q.shape[0], k_seq.shape[1]
    k = k_seq.repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
    v = v_seq.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, k) * scale  # [Hq, L]
    length = k.shape[0]
    if window is not None:
        visible = torch.arange(length) > length - 1 - window
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("window", [None, 5])
@torch.no_grad()
def test_bucketed_block_decode_matches_per_sequence_attention(window, path, monkeypatch):
    """Both decode paths: the CPU kernel reading the paged cache in place, and the torch path
    (block gathers + SDPA) that CUDA, other dtypes and ``BATCHGEN_CPU_KERNELS=0`` take."""
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "1" if path == "kernel" else "0")
    if path == "kernel" and not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here")
    cpu = torch.device("cpu")
    assert decode_kernel_available(cpu, torch.float32) == (path == "kernel")
    torch.manual_seed(0)
    block_size, num_blocks, hq, hkv, d = 4, 64, 4, 2, 8
    kv_lens = [1, 3, 4, 5, 9, 17, 30, 31]  # sorted, spans several buckets
    k_cache = torch.randn(num_blocks * block_size, hkv, d)
    v_cache = torch.randn(num_blocks * block_size, hkv, d)
    perm = torch.randperm(num_blocks).tolist()  # scattered blocks: paging is exercised
    tables, taken = [], 0
    for n in kv_lens:
        nb = math.ceil(n / block_size)
        tables.append(perm[taken : taken + nb])
        taken += nb
    b = len(kv_lens)
    q = torch.randn(b, hq, d)
    k_new, v_new = torch.randn(b, hkv, d), torch.randn(b, hkv, d)
    slot_mapping = torch.tensor(
        [
            tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size
            for i, n in enumerate(kv_lens)
        ]
    )
    buckets = []
    for start, end in plan_decode_buckets([len(t) for t in tables]):
        width = len(tables[end - 1])
        buckets.append(
            DecodeBucket(
                start,
                end,
                torch.tensor([t + [0] * (width - len(t)) for t in tables[start:end]]),
                torch.tensor(kv_lens[start:end]),
            )
        )
    assert len(buckets) > 1
    meta = AttentionMetadata(
        positions=torch.tensor([n - 1 for n in kv_lens]),
        slot_mapping=slot_mapping,
        num_decode_tokens=b,
        decode_buckets=buckets,
        block_size=block_size,
    )
    scale = d**-0.5
    out = paged_attention(q, k_new, v_new, (k_cache, v_cache), meta, scale, window)
    for i, n in enumerate(kv_lens):
        slots = torch.tensor(
            [tables[i][p // block_size] * block_size + p % block_size for p in range(n)]
        )
        expect = _reference(q[i], k_cache[slots], v_cache[slots], scale, window)
        torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5)
    # The new K/V were written at each sequence's last slot.
    torch.testing.assert_close(k_cache[slot_mapping], k_new)
