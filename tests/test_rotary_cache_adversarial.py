"""Nasty inputs for RoPE with the paged KV cache write in one pass
(`rotary_embedding_and_cache_`, ``csrc/rotary_embedding.cpp``) and the in-place rotation
(`rotary_embedding_`): the kernel writes q, k and cache rows in place from several threads, so
every bound and overlap is checked in Python first.

Found by this file (failed before its fix): k aliasing q (``rotary_embedding_(q, q, ...)``)
was served, rotating each element twice (eager rotates each once, out of place), and a cache
that overlaps q, k or v was written over the rows being read. Passing from the start (kept as
regression tests): head sizes 2-128 with the scalar tail (80, 96), llama3 scaling, 0-300 rows
on two threads, fp32 and bf16 bit for bit the rotation then ``index_copy_``; slots -1, past
the end or 2^62 refused with nothing written; the views of one fused qkv row served.
"""

import pytest
import torch

from batchgen.kernels.rotary_embedding import (
    rotary_embedding_,
    rotary_embedding_and_cache_,
    rotary_embedding_and_cache_available,
    rotary_embedding_available,
)
from batchgen.models.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not rotary_embedding_available(
        torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    ),
    reason="rotary kernel not built",
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


def _qkv(tokens, hq, hkv, d, dtype):
    """q, k, v ``[T, H, D]`` as views of one fused projection ``[T, (Hq + 2 Hkv) D]``."""
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d) * 3).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [2, 6, 64, 80, 96, 128])
def test_head_sizes_and_row_counts_are_the_two_step_path_bit_for_bit(dtype, d):
    torch.manual_seed(d)
    torch.set_num_threads(2)
    rope = RotaryEmbedding(d, LLAMA3)
    for tokens in (0, 1, 63, 64, 65, 300):
        q, k, v = _qkv(tokens, 4, 2, d, dtype)
        positions = torch.randint(0, 5000, (tokens,))
        slots = torch.randperm(2 * tokens + 5)[:tokens]
        k_cache = torch.randn(2 * tokens + 5, 2, d).to(dtype)
        v_cache = torch.randn_like(k_cache)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        q0, k0 = rope(positions, q.clone(), k.clone(), None)  # eager, out of place
        ref_k.index_copy_(0, slots, k0)
        ref_v.index_copy_(0, slots, v)
        assert rope.rotate_and_cache_(positions, q, k, v, {}, (k_cache, v_cache), slots)
        assert torch.equal(q, q0) and torch.equal(k, k0), tokens
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), tokens


def test_slots_out_of_range_write_nothing():
    rope = RotaryEmbedding(64, LLAMA3)
    q, k, v = _qkv(100, 4, 2, 64, torch.float32)
    cos, sin = rope.cos_sin(torch.arange(100), torch.float32)
    kv = (torch.zeros(205, 2, 64), torch.zeros(205, 2, 64))
    q_before, k_before = q.clone(), k.clone()
    for bad in (-1, 205, 2**62):  # vLLM's -1 padding slot: the engine never emits it on CPU
        slots = torch.arange(100)
        slots[57] = bad
        with pytest.raises(ValueError, match=r"outside \[0, 205\)"):
            rotary_embedding_and_cache_(q, k, v, cos, sin, kv, slots)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    assert not kv[0].any() and not kv[1].any()


def test_overlapping_q_and_k_are_refused():
    rope = RotaryEmbedding(8, {"rope_theta": 10000.0})
    cos, sin = rope.cos_sin(torch.arange(5), torch.float32)
    q = torch.randn(5, 2, 8)
    assert not rotary_embedding_available(q, q, cos, sin)  # k is q
    assert not rotary_embedding_available(q, q[:, 1:], cos, sin)  # k is q's second head
    with pytest.raises(ValueError, match="sharing no memory"):
        rotary_embedding_(q, q, cos, sin)
    q0, k0 = rope(torch.arange(5), q, q, inplace=True)  # falls back: each rotated once
    assert torch.equal(q0, k0) and q0.data_ptr() != q.data_ptr()
    qkv = _qkv(5, 2, 1, 8, torch.float32)  # the fused projection's views: served
    assert rotary_embedding_available(qkv[0], qkv[1], cos, sin)
    single = torch.randn(1, 4, 8)  # one row: heads 0-1 and 2-3 apart, 1-2 and 0-1 not
    assert rotary_embedding_available(single[:, :2], single[:, 2:], cos[:1], sin[:1])


def test_a_cache_overlapping_q_k_or_v_is_refused():
    rope = RotaryEmbedding(8, {"rope_theta": 10000.0})
    pos, slots = torch.arange(5), torch.arange(5)
    cos, sin = rope.cos_sin(pos, torch.float32)
    q, k, v = _qkv(5, 2, 1, 8, torch.float32)
    kv = (torch.zeros(16, 1, 8), torch.zeros(16, 1, 8))
    assert rotary_embedding_and_cache_available(q, k, v, cos, sin, kv, slots)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for bad_kv in [
        (k2.reshape(5, 1, 8), kv[1]),  # the k cache is k itself
        (kv[0], v2.reshape(5, 1, 8)),  # the v cache is v
    ]:
        assert not rotary_embedding_and_cache_available(q2, k2, v2, cos, sin, bad_kv, slots)
        with pytest.raises(ValueError, match="sharing no memory"):
            rotary_embedding_and_cache_(q2, k2, v2, cos, sin, bad_kv, slots)
    k_cache = torch.zeros(16, 1, 8)  # q is the cache's first 5 rows
    assert not rotary_embedding_and_cache_available(
        k_cache[:5], k2, v2, cos, sin, (k_cache, kv[1]), slots
    )
