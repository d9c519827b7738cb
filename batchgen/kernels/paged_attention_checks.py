"""The argument checks of `batchgen.kernels.paged_attention.paged_decode_attention`: the kernel
reads raw memory through the pointers it is given, so shapes, dtypes, layouts, block ids and
context lengths are checked first (ValueError naming the argument)."""

from __future__ import annotations

import math

import torch

_DTYPES = (torch.float32, torch.bfloat16)  # q's dtypes
# (q dtype, cache dtype) pairs the mixed entry serves (csrc/paged_decode_attention_mixed.h):
# a KV cache narrower than q (vLLM's kv_cache_dtype).
MIXED_PAIRS = (
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.float32, torch.float8_e5m2),
    (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2),
)


def rows_strided_ok(q: torch.Tensor) -> bool:
    """True when the kernel can read ``q [B, Hq, D]`` in place: each row's ``Hq * D`` elements
    contiguous and rows at least that far apart (``q.stride(0) >= Hq * D``, which a view of a
    wider row such as fused QKV has; the kernel reads only ``q.data_ptr() + b * stride(0) +
    [0, Hq * D)``, inside q's storage for any such view). Size-1 dimensions' strides are
    free in torch, so those are not compared."""
    b, hq, d = q.shape
    return (
        (d <= 1 or q.stride(2) == 1)
        and (hq <= 1 or q.stride(1) == d)
        and (b <= 1 or q.stride(0) >= hq * d)
        and q.storage_offset() + (b - 1) * q.stride(0) + hq * d <= q.untyped_storage().nbytes()
        // q.element_size()
    )


def check_args(
    q, k_cache, v_cache, block_tables, kv_lens, block_size, out, sliding_window, context_checked
) -> None:
    dims = (("q", q, 3), ("k_cache", k_cache, 3), ("v_cache", v_cache, 3), ("out", out, 3))
    for name, t, want in (*dims, ("block_tables", block_tables, 2), ("kv_lens", kv_lens, 1)):
        if t.dim() != want:
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
    # bool is an int: True would run as 1
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    window_ok = isinstance(sliding_window, int) and not isinstance(sliding_window, bool)
    if sliding_window is not None and (not window_ok or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if k_cache.shape[0] % block_size:
        raise ValueError(
            f"k_cache rows ({k_cache.shape[0]}) must be a multiple of block_size ({block_size})"
        )
    if q.dtype not in _DTYPES or q.device.type != "cpu":
        raise ValueError(f"q must be a float32 or bfloat16 CPU tensor, got {q.dtype} on {q.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.device.type != "cpu" or (name == "out" and t.dtype != q.dtype):
            raise ValueError(
                f"{name} must be a {q.dtype} CPU tensor like q, got {t.dtype} on {t.device}"
            )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out.shape != q.shape or v_cache.shape != k_cache.shape or k_cache.shape[2] != q.shape[2]:
        raise ValueError(
            f"shapes: q {tuple(q.shape)}, out {tuple(out.shape)}, k_cache "
            f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if block_tables.dtype != torch.int64 or kv_lens.dtype != torch.int64:
        raise ValueError("block_tables and kv_lens must be int64")
    for name, t in (("block_tables", block_tables), ("kv_lens", kv_lens)):
        if t.device.type != "cpu":  # read as raw pointers by the kernel
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if block_tables.shape[0] != q.shape[0] or kv_lens.shape != (q.shape[0],):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and kv_lens {tuple(kv_lens.shape)} "
            f"must have one row per query ({q.shape[0]})"
        )
    if q.shape[0] and not context_checked:
        check_decode_context(block_tables, kv_lens, block_size, k_cache.shape[0] // block_size)


def check_cache_dtype(q, k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the caches are of a narrower dtype than q (the mixed entry); ValueError naming
    the argument for an unserved pairing (listing the served ones) or a bad scale."""
    pairs = ", ".join(f"{str(a)[6:]}/{str(c)[6:]}" for a, c in MIXED_PAIRS)
    if k_cache.dtype != v_cache.dtype:
        name = "k_cache" if v_cache.dtype == q.dtype else "v_cache"  # the odd one out
        raise ValueError(
            f"{name} must be a {q.dtype} CPU tensor like q, or k_cache and v_cache of one "
            f"narrower dtype (q/cache: {pairs}); got k_cache {k_cache.dtype}, v_cache "
            f"{v_cache.dtype}"
        )
    if k_cache.dtype == q.dtype:
        if k_scale != 1.0 or v_scale != 1.0:
            raise ValueError(
                f"k_scale and v_scale must be 1.0 for a cache of q's dtype ({q.dtype}), got "
                f"{k_scale!r}, {v_scale!r}"
            )
        return False
    if (q.dtype, k_cache.dtype) not in MIXED_PAIRS:
        raise ValueError(
            f"k_cache must be a {q.dtype} CPU tensor like q or of a narrower dtype (q/cache: "
            f"{pairs}), got {k_cache.dtype}"
        )
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        ok = isinstance(x, (int, float)) and not isinstance(x, bool)
        if not ok or not math.isfinite(x) or x <= 0:
            raise ValueError(f"{name} must be a finite float > 0, got {x!r}")
    return True


def check_decode_context(
    block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int, num_blocks: int
) -> None:
    """The checks of `paged_decode_attention` that read the metadata's values: every context
    length in ``[1, block_tables width x block_size]`` and every block id a context reaches in
    ``[0, num_blocks)`` (the kernel reads raw memory there).

    Args:
        block_tables: ``[B, n]`` int64; kv_lens: ``[B]`` int64 (B >= 1); block_size: tokens
            per block; num_blocks: blocks in the cache.
    Raises:
        ValueError: naming ``kv_lens`` or ``block_tables``.
    """
    if kv_lens.min() < 1 or kv_lens.max() > block_tables.shape[1] * block_size:
        raise ValueError(
            f"kv_lens must be in [1, {block_tables.shape[1] * block_size}] (block_tables width "
            f"x block_size), got [{int(kv_lens.min())}, {int(kv_lens.max())}]"
        )
    # Only the entries a context reaches are read; padding past it may hold anything.
    width = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = width < (kv_lens[:, None] + block_size - 1) // block_size
    ids = block_tables[used]
    if ids.numel() and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"block_tables entries must be in [0, {num_blocks}) where read")
