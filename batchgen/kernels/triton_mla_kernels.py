"""The Triton kernels of `batchgen.kernels.triton_mla_decode` (MLA's absorbed decode on the
paged latent cache), imported lazily on first use, like `batchgen.kernels.triton_moe_kernels`,
so ``TRITON_INTERPRET`` can be set first.

Shape legend: B = decode sequences, N = heads, C = kv_lora_rank, Dr = qk_rope_head_dim,
S = KV splits, BLOCK_N = keys per inner step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_decode_attention_kernel(
    q_nope_ptr,  # [B, N, C] q_nope with W_UK absorbed
    q_pe_ptr,  # [B, N, Dr] rotated rope queries
    c_kv_ptr,  # [num_slots, C] normalised latents (the keys' first part and the values)
    k_pe_ptr,  # [num_slots, Dr] rotated rope keys
    out_ptr,  # [B, N, C] latent-space context (written when NUM_SPLITS == 1)
    mid_out_ptr,  # [B, N, S, C] float32 per-split contexts (written when NUM_SPLITS > 1)
    mid_lse_ptr,  # [B, N, S] float32 per-split log-sum-exp of the scores
    block_tables_ptr,  # [B, n] int32 / int64 block ids
    kv_lens_ptr,  # [B] int context lengths including the new token
    scale,  # softmax scale (float32)
    num_heads,
    kv_lora_rank,
    rope_dim,
    block_size,  # tokens per KV block
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_cs,  # c_kv stride between slots
    stride_ps,  # k_pe stride between slots
    stride_ob,
    stride_oh,
    stride_bt,
    NUM_SPLITS: tl.constexpr,  # S: the context cut into S nearly equal parts
    BLOCK_H: tl.constexpr,  # heads per program, a power of two >= 16 (tl.dot's smallest M)
    BLOCK_C: tl.constexpr,  # C padded to a power of two >= 16
    BLOCK_R: tl.constexpr,  # Dr padded to a power of two >= 16
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, block of BLOCK_H heads, KV split). MLA's absorbed decode is
    multi-query attention with one key head ``[c_kv, k_pe]`` (C + Dr wide) and one value head
    ``c_kv`` shared by all N heads, so the head block is the query tile of one GEMM per step, as
    the GQA group is in `paged_decode_attention_kernel`; scores are the two partial products
    ``q_nope . c_kv + q_pe . k_pe`` (the latent and rope parts stay in their own caches, so
    nothing is concatenated). Latents and rope keys are read in place through the block table,
    BLOCK_N positions per step, each read once per head block and used for both QK and PV;
    online softmax (running max, running sum, float32 accumulator), the probabilities rounded
    to the cache dtype for the PV product.

    Split s covers positions ``[s * ceil(L / S), min((s + 1) * ceil(L / S), L))``; a split
    past the context (L < S) writes nothing (`mla_decode_reduce_kernel` skips it by the same
    rule). With S == 1 the program writes the output directly."""
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int64)
    split_len = tl.cdiv(kv_len, NUM_SPLITS)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)
    if hi > lo:  # the split holds key lo, so every step has a key and the max stays finite
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
        offs_c = tl.arange(0, BLOCK_C)
        offs_r = tl.arange(0, BLOCK_R)
        h_mask = heads < num_heads
        c_mask = offs_c < kv_lora_rank
        r_mask = offs_r < rope_dim
        q_nope = tl.load(
            q_nope_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_c[None, :],
            mask=h_mask[:, None] & c_mask[None, :],
            other=0.0,
        )  # [BLOCK_H, BLOCK_C]
        q_pe = tl.load(
            q_pe_ptr + seq * stride_pb + heads[:, None] * stride_ph + offs_r[None, :],
            mask=h_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_H, BLOCK_R]
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            visible = pos < hi
            block_ids = tl.load(
                block_tables_ptr + seq * stride_bt + pos // block_size, mask=visible, other=0
            ).to(tl.int64)
            slots = block_ids * block_size + pos % block_size  # [BLOCK_N]
            c_kv = tl.load(
                c_kv_ptr + slots[:, None] * stride_cs + offs_c[None, :],
                mask=visible[:, None] & c_mask[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_C]
            k_pe = tl.load(
                k_pe_ptr + slots[:, None] * stride_ps + offs_r[None, :],
                mask=visible[:, None] & r_mask[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_R]
            scores = tl.dot(q_nope, tl.trans(c_kv), input_precision=DOT_PRECISION)
            scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
            scores = tl.where(visible[None, :], scores * scale, float("-inf"))  # [BLOCK_H, N]
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])  # [BLOCK_H, BLOCK_N]
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(
                p.to(c_kv.dtype), c_kv, input_precision=DOT_PRECISION
            )  # [BLOCK_H, BLOCK_C]
            m_i = m_new
        out = acc / l_i[:, None]
        out_mask = h_mask[:, None] & c_mask[None, :]
        if NUM_SPLITS == 1:
            o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            row = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H] of [B, N, S]
            mid_ptrs = mid_out_ptr + row[:, None] * kv_lora_rank + offs_c[None, :]
            tl.store(mid_ptrs, out, mask=out_mask)
            tl.store(mid_lse_ptr + row, m_i + tl.log(l_i), mask=h_mask)


@triton.jit
def mla_decode_reduce_kernel(
    mid_out_ptr,  # [B, N, S, C] float32 per-split contexts (each normalised by its own sum)
    mid_lse_ptr,  # [B, N, S] float32 per-split log-sum-exp
    out_ptr,  # [B, N, C]
    kv_lens_ptr,  # [B] int context lengths
    num_heads,
    kv_lora_rank,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per (sequence, head): the S split contexts merged by their log-sum-exps,
    ``out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)`` with ``M`` the running max
    (FlashDecoding's reduction); splits past the context (the rule of
    `mla_decode_attention_kernel`) are skipped."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int64)
    split_len = tl.cdiv(kv_len, NUM_SPLITS)
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < kv_lora_rank
    base = (seq * num_heads + head) * NUM_SPLITS
    m = float("-inf")
    total = 0.0
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for split in tl.static_range(NUM_SPLITS):  # split 0 always holds key 0: m turns finite
        valid = split * split_len < kv_len
        # An empty split's slots were never written: read (in bounds) and discarded.
        lse = tl.where(valid, tl.load(mid_lse_ptr + base + split), float("-inf"))
        part = tl.load(mid_out_ptr + (base + split) * kv_lora_rank + offs_c, mask=c_mask)
        part = tl.where(valid, part, 0.0)  # [BLOCK_C]
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(lse - m_new)
        acc = acc * alpha + part * beta
        total = total * alpha + beta
        m = m_new
    o_ptrs = out_ptr + seq * stride_ob + head * stride_oh + offs_c
    tl.store(o_ptrs, (acc / total).to(out_ptr.dtype.element_ty), mask=c_mask)
