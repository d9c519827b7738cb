"""The Triton kernels of `batchgen.kernels.triton_moe` (imported lazily, on first use, so that
importing the engine never imports ``triton`` and a test can set ``TRITON_INTERPRET=1`` first:
``triton.jit`` reads that variable when it decorates these functions).

Shape legend: R = T*A token activations (flat index ``t * A + a``), E = num_experts,
N / K = the GEMM's output / contraction size, BLOCK_M/N/K the tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The ``ROUND_TO`` constexpr for each activation dtype.
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype``: ``"ieee"`` for float32, so
    that float32 GEMMs on a GPU are full float32 as torch's are by default (triton's default
    rounds the inputs to TF32); the default ``"tf32"`` otherwise (ignored for 16-bit inputs)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def fused_moe_gemm_kernel(
    a_ptr,  # [rows of A, K]: x [T, K] (A_DIV = top_k) or an intermediate [R, K] (A_DIV = 1)
    b_ptr,  # [E, N, K]: w13 [E, 2I, H] or w2 [E, H, I]
    c_ptr,  # [R, N]: receives row r = flat index of the activation
    topk_weights_ptr,  # [R] float32 (read when MUL_ROUTED_WEIGHT)
    sorted_token_ids_ptr,  # [max_padded] int32: flat indices grouped by expert, R = padding
    expert_ids_ptr,  # [max_padded // BLOCK_M] int32: the expert of each BLOCK_M row block
    num_tokens_post_padded_ptr,  # [1] int32: rows of sorted_token_ids in use
    N,
    K,
    num_valid_tokens,  # R: sorted ids >= R are padding
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ROUND_TO: tl.constexpr,  # the activations' dtype: the accumulator is rounded to it once
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (tl.dot's default would be TF32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``C[r] = A[r // A_DIV] @ B[expert]^T`` for the rows
    ``r`` of one BLOCK_M block of ``sorted_token_ids`` (all of one expert, padded with R).
    The float32 accumulator is rounded to ``ROUND_TO`` (as `F.linear`'s output is), then, with
    ``MUL_ROUTED_WEIGHT``, widened and multiplied by the row's router weight in float32."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return  # a block past the padded rows in use (the grid is sized for the worst case)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    token_ids = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M]
    token_mask = token_ids < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = tl.where(token_mask, token_ids // A_DIV, 0)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=token_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] f32
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out = acc.to(ROUND_TO)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + token_ids, mask=token_mask, other=0.0)
        out = out.to(tl.float32) * weight[:, None]
    c_ptrs = c_ptr + token_ids[:, None] * stride_cm + offs_n[None, :]
    c_mask = token_mask[:, None] & (offs_n[None, :] < N)
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def silu_and_mul_kernel(
    gate_up_ptr,  # [R, 2I]: gate columns, then up columns
    out_ptr,  # [R, I]
    inter,  # I
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
):
    """``out[r] = round(round(silu(gate[r])) * up[r])``: the two roundings of torch's
    ``F.silu(gate) * up`` in a 16-bit dtype, computed in float32 (``silu(g) = g *
    sigmoid(g)``). One program per (row, BLOCK columns)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)
    out = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
