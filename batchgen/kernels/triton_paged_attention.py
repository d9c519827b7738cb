"""Paged decode attention in Triton: the CUDA decode path that reads K/V in place through the
block table (`batchgen.kernels.triton_attention_kernels`), instead of the torch path's gather
of each bucket's blocks into a padded copy before SDPA
(`batchgen.models.layers.attention.paged_attention`).

One program per (sequence, KV head); the GQA group's query heads share each key and value
read (from HBM once per KV head, not once per query head), and the online softmax walks the
context BLOCK_N positions at a time, skipping the positions a sliding window hides. The same
arguments and result as the CPU kernel `batchgen.kernels.paged_attention.paged_decode_attention`
and the torch path; which one runs is chosen in
`batchgen.models.layers.attention_backend.decode_attention_backend`.

Never yet run on a GPU (see docs/gpu.md); proven on CPU under ``TRITON_INTERPRET=1`` in
float32 and float16 (``tests/test_triton_kernels.py``).
"""

from __future__ import annotations

import torch

from batchgen.kernels.paged_attention import check_decode_context
from batchgen.kernels.triton_support import triton_unsupported_reason

BLOCK_N = 64  # keys per inner step (untuned: a device measurement)


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << max(n - 1, 0).bit_length())


def triton_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    context_checked: bool = False,
) -> None:
    """One decode token per sequence attends to its cached context; writes ``out``.

    Args:
        q: ``[B, Hq, D]`` float32, float16 or bfloat16 (the new tokens' queries, RoPE applied),
            last dim contiguous.
        k_cache, v_cache: ``[num_blocks * block_size, Hkv, D]``, q's dtype and device, last dim
            contiguous, the new tokens' K/V already written.
        block_tables: ``[B, n]`` int32 / int64 block ids (entries past a context are not read).
        kv_lens: ``[B]`` int context lengths including the new token (>= 1); the query sits at
            position ``kv_len - 1``.
        block_size: tokens per KV block; scale: softmax scale; sliding_window: HF's rule (key j
            visible iff ``pos - j < window``) or None.
        out: ``[B, Hq, D]``, q's dtype and device, last dim contiguous: receives
            ``softmax(q k^T * scale) v`` per (sequence, query head), query head h reading KV
            head ``h // (Hq / Hkv)``. Scores and softmax in float32, the probabilities rounded
            to the cache dtype for the PV product, the output rounded once.
        context_checked: the caller ran `check_decode_context` on these ``block_tables`` and
            ``kv_lens`` for this cache (once per step; it syncs with the host).
    Raises:
        ValueError: naming the argument: a wrong rank, shape, dtype, device or layout, Hq not
        a multiple of Hkv, a context or block id outside the cache, or a device / dtype the
        kernel cannot run on (`triton_unsupported_reason`).
    """
    for name, t, want in (("q", q, 3), ("k_cache", k_cache, 3), ("v_cache", v_cache, 3),
                          ("out", out, 3), ("block_tables", block_tables, 2),
                          ("kv_lens", kv_lens, 1)):  # fmt: skip
        if t.dim() != want:
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    reason = triton_unsupported_reason(q.device, q.dtype)
    if reason is not None:
        raise ValueError(f"Triton paged decode attention cannot run: {reason}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must be {q.dtype} like q, got {t.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if out.shape != q.shape or v_cache.shape != k_cache.shape or k_cache.shape[2] != d:
        raise ValueError(
            f"shapes: q {tuple(q.shape)}, out {tuple(out.shape)}, k_cache "
            f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of the KV heads ({hkv})")
    if not isinstance(block_size, int) or block_size < 1 or k_cache.shape[0] % block_size:
        raise ValueError(
            f"block_size must be a positive int dividing the cache's {k_cache.shape[0]} slots, "
            f"got {block_size!r}"
        )
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if block_tables.shape[0] != b or kv_lens.shape != (b,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and kv_lens {tuple(kv_lens.shape)} "
            f"must have one row per query ({b})"
        )
    if b == 0:
        return
    if not context_checked:
        check_decode_context(block_tables, kv_lens, block_size, k_cache.shape[0] // block_size)
    from batchgen.kernels import triton_attention_kernels as kernels
    from batchgen.kernels.triton_moe_kernels import dot_precision

    group = hq // hkv
    kernels.paged_decode_attention_kernel[(b, hkv)](
        q, k_cache, v_cache, out, block_tables, kv_lens,
        float(scale), sliding_window or 0, d, block_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group,
        BLOCK_G=_pow2_at_least_16(group),
        BLOCK_D=_pow2_at_least_16(d),
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
