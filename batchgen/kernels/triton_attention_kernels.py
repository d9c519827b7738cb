"""The Triton kernel of `batchgen.kernels.triton_paged_attention` (imported lazily on first
use, like `batchgen.kernels.triton_moe_kernels`, so ``TRITON_INTERPRET`` can be set first).

Shape legend: B = decode sequences, Hq / Hkv = query / KV heads, G = Hq / Hkv (GQA group),
D = head_size, BLOCK_N = keys per inner step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_decode_attention_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_slots, Hkv, D]
    v_cache_ptr,  # [num_slots, Hkv, D]
    out_ptr,  # [B, Hq, D]
    block_tables_ptr,  # [B, n] int32 / int64 block ids
    kv_lens_ptr,  # [B] int context lengths including the new token
    scale,  # softmax scale (float32)
    sliding_window,  # 0: none; else key j visible iff (kv_len - 1) - j < sliding_window
    head_size,
    block_size,  # tokens per KV block
    stride_qb,
    stride_qh,
    stride_cs,  # cache stride between slots
    stride_ch,  # cache stride between KV heads
    stride_ob,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # G query heads per KV head
    BLOCK_G: tl.constexpr,  # G padded to a power of two >= 16 (tl.dot's smallest M)
    BLOCK_D: tl.constexpr,  # D padded to a power of two >= 16
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, KV head): the G query heads that share the KV head are the
    rows of one ``[BLOCK_G, BLOCK_D]`` query tile (HF's ``repeat_kv`` order: query head h reads
    KV head h // G). Keys and values are read in place, slot ``block_tables[b, j // block_size]
    * block_size + j % block_size`` for position j, BLOCK_N positions per step, with the online
    softmax of FlashAttention (running max ``m``, running sum ``l``, float32 accumulator;
    scores and softmax in float32, the probabilities rounded to the cache dtype for the PV
    product as FlashAttention does)."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_size
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    lo = tl.where(sliding_window > 0, tl.maximum(kv_len - sliding_window, 0), 0)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    cache_head = kv_head * stride_ch + offs_d[None, :]  # [1, BLOCK_D]
    # The first step starts at lo rounded down to BLOCK_N, so it holds key lo (kv_len > lo):
    # every step has a visible key and the running max stays finite.
    for start in range((lo // BLOCK_N) * BLOCK_N, kv_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        visible = (pos < kv_len) & (pos >= lo)
        block_ids = tl.load(
            block_tables_ptr + seq * stride_bt + pos // block_size, mask=visible, other=0
        ).to(tl.int64)
        slots = block_ids * block_size + pos % block_size  # [BLOCK_N]
        kv_mask = visible[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + slots[:, None] * stride_cs + cache_head, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [G, N] f32
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + slots[:, None] * stride_cs + cache_head, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=DOT_PRECISION
        )  # [BLOCK_G, BLOCK_D]
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
