"""Rotary position embedding on CPU, in place on q and k in one kernel call
(``csrc/rotary_embedding.cpp``), float32 and bfloat16.

`rotary_embedding_` computes Hugging Face's ``q * cos + rotate_half(q) * sin`` (and the same for
k) with torch's roundings, bit for bit, writing into q and k instead of ten torch ops.
Where the kernel does not serve (not CPU, other dtypes, a layout it does not read, gradients, the
library not built, ``BATCHGEN_CPU_KERNELS`` without ``rotary_embedding``)
`rotary_embedding_available` is False and the caller runs the eager ops.

Shape legend: T = num_tokens, Hq / Hkv = query / key heads, D = head_dim (the rotary dim).
"""

from __future__ import annotations

import ctypes

import torch
from torch.profiler import record_function

from batchgen.kernels.cpu_build import kernels_enabled, load_library

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_fns: dict[torch.dtype, object] | None = None


def _functions() -> dict[torch.dtype, object]:
    """The kernel's entry points by dtype; empty while the library is unavailable."""
    global _fns
    if _fns is None:
        lib = load_library("rotary_embedding")
        fns: dict[torch.dtype, object] = {}
        if lib is not None:
            for dtype, name in (
                (torch.float32, "batchgen_rotary_f32"),
                (torch.bfloat16, "batchgen_rotary_bf16"),
            ):
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int
                fn.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64]
                fns[dtype] = fn
                # the same rotation with the paged KV cache write (`rotary_embedding_and_cache_`)
                fn = getattr(lib, name.replace("rotary", "rotary_cache"))
                fn.restype = ctypes.c_int
                fn.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64]
                fn.argtypes += [_ptr, _i64, _ptr, _ptr, _ptr, _i64]
                fns[(dtype, "cache")] = fn
        _fns = fns
    return _fns


def _heads_ok(x: torch.Tensor, d: int) -> bool:
    """``x [T, H, D]`` with adjacent heads of contiguous values, rows that do not overlap (any
    row stride from ``H * D``: the kernel writes rows in place from several threads)."""
    return (
        x.dim() == 3
        and x.shape[2] == d
        and x.stride(2) == 1
        and x.stride(1) == d
        and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1] * d)
    )


def _layout_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The shapes, strides, dtypes and devices the kernel reads as raw memory."""
    d = q.shape[-1] if q.dim() == 3 else -1
    return (
        d > 0
        and d % 2 == 0
        and all(t.device.type == "cpu" and t.dtype == q.dtype for t in (q, k, cos, sin))
        and q.dtype in (torch.float32, torch.bfloat16)
        and _heads_ok(q, d)
        and _heads_ok(k, d)
        and k.shape[0] == q.shape[0]
        and cos.shape == sin.shape == (q.shape[0], 1, d)
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def rotary_embedding_available(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> bool:
    """True when `rotary_embedding_` serves ``q [T, Hq, D]``, ``k [T, Hkv, D]`` and
    ``cos, sin [T, 1, D]``: all on CPU, one dtype (float32 or bfloat16), heads adjacent and
    contiguous within a row (views of a fused qkv projection qualify), cos/sin contiguous,
    no gradient needed, the kernel built and enabled."""
    return (
        _layout_ok(q, k, cos, sin)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin)))
        and kernels_enabled("rotary_embedding")
        and q.dtype in _functions()
    )


def rotary_embedding_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place: ``x * cos + rotate_half(x) *
    sin`` with ``rotate_half([x1, x2]) = [-x2, x1]`` (RoFormer, HF `apply_rotary_pos_emb`),
    each product and sum rounded to x's dtype as torch's eager ops round them.

    Args:
        q, k: as `rotary_embedding_available` requires; overwritten.
        cos, sin: ``[T, 1, D]`` of q's dtype.
    Returns:
        ``(q, k)``, the same tensors.
    Raises:
        ValueError: a layout the kernel cannot read (as `rotary_embedding_available` lists;
            a cos of one row for T tokens was read past its end).
        RuntimeError: the kernel rejected the shapes.
    Call only where `rotary_embedding_available` is True."""
    if not _layout_ok(q, k, cos, sin):
        raise ValueError(
            f"rotary_embedding_: q {tuple(q.shape)}, k {tuple(k.shape)}, cos "
            f"{tuple(cos.shape)}, sin {tuple(sin.shape)} ({q.dtype}, {cos.dtype}): the kernel "
            "reads q [T, Hq, D] and k [T, Hkv, D] with contiguous heads and cos, sin "
            "[T, 1, D] contiguous, one dtype (float32 or bfloat16), on the CPU"
        )
    return rotary_embedding_checked_(q, k, cos, sin)


def rotary_embedding_checked_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding_` without its layout check, for a caller that has just had
    `rotary_embedding_available` answer True for these very tensors (the check reads ~20
    shapes and strides: once per layer call, not twice). Raises RuntimeError when the kernel
    rejects the shapes."""
    t, hq, d = q.shape
    if t == 0:
        return q, k
    args = (
        q.data_ptr(), q.stride(0), hq, k.data_ptr(), k.stride(0), k.shape[1], d,
        cos.data_ptr(), sin.data_ptr(), t, torch.get_num_threads(),
    )  # fmt: skip
    fn = _functions()[q.dtype]
    if torch.autograd._profiler_enabled():  # the scope costs ~5 us even when not profiled
        with record_function("batchgen::rotary_embedding"):
            rc = fn(*args)
    else:
        rc = fn(*args)
    if rc != 0:
        raise RuntimeError(f"rotary kernel rejected q {tuple(q.shape)}, k {tuple(k.shape)}")
    return q, k


def _cache_layout_ok(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """v laid out as k (`_heads_ok`), caches ``[num_slots, Hkv, D]`` contiguous of k's dtype,
    ``slot_mapping [T]`` contiguous int64, all on the CPU."""
    hk, d = k.shape[1], k.shape[2]
    return (
        v.shape == k.shape
        and v.dtype == k.dtype
        and _heads_ok(v, d)
        and all(
            c.dim() == 3
            and c.shape[1:] == (hk, d)
            and c.dtype == k.dtype
            and c.is_contiguous()
            and c.device.type == "cpu"
            for c in (k_cache, v_cache)
        )
        and k_cache.shape[0] == v_cache.shape[0]
        and v.device.type == "cpu"
        and slot_mapping.device.type == "cpu"
        and slot_mapping.dtype == torch.int64
        and slot_mapping.shape == (k.shape[0],)
        and slot_mapping.is_contiguous()
    )


def rotary_embedding_and_cache_available(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
) -> bool:
    """True when `rotary_embedding_and_cache_` serves these tensors: `rotary_embedding_available`
    for q, k, cos, sin, v laid out as k, the caches ``[num_slots, Hkv, D]`` contiguous of
    q's dtype and ``slot_mapping [T]`` contiguous int64, all on the CPU, no gradient."""
    return (
        rotary_embedding_available(q, k, cos, sin)
        and not (torch.is_grad_enabled() and v.requires_grad)
        and _cache_layout_ok(k, v, kv_cache[0], kv_cache[1], slot_mapping)
        and (q.dtype, "cache") in _functions()
    )


def rotary_embedding_and_cache_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding_` on ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` (in place, the same bits),
    then the rotated ``k`` and ``v [T, Hkv, D]`` written to rows ``slot_mapping [T]`` (int64)
    of ``kv_cache = (k_cache, v_cache)``, each ``[num_slots, Hkv, D]``: one kernel pass instead
    of the rotation and two ``index_copy_`` (vLLM's ``reshape_and_cache`` fused with RoPE).

    Returns:
        ``(q, k)``, the same tensors.
    Raises:
        ValueError: a layout the kernel cannot read (`rotary_embedding_and_cache_available`
            lists them), or a slot outside ``[0, num_slots)`` (nothing is written then).
        RuntimeError: the kernel rejected the shapes.
    Call only where `rotary_embedding_and_cache_available` is True."""
    k_cache, v_cache = kv_cache
    if not (_layout_ok(q, k, cos, sin) and _cache_layout_ok(k, v, k_cache, v_cache, slot_mapping)):
        raise ValueError(
            f"rotary_embedding_and_cache_: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
            f"{tuple(v.shape)}, caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
            f"({k_cache.dtype}), slot_mapping {tuple(slot_mapping.shape)} "
            f"{slot_mapping.dtype}: the kernel reads q, k, v as [T, H, D] with contiguous heads, "
            "caches [num_slots, Hkv, D] contiguous of q's dtype, slot_mapping [T] int64, CPU"
        )
    return rotary_embedding_and_cache_checked_(q, k, v, cos, sin, kv_cache, slot_mapping)


def rotary_embedding_and_cache_checked_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding_and_cache_` without its layout check, for a caller that has just had
    `rotary_embedding_and_cache_available` answer True for these very tensors. The kernel
    still checks every slot against the cache's rows. Raises ValueError for a slot outside
    ``[0, num_slots)`` (nothing written), RuntimeError when the kernel rejects the shapes."""
    k_cache, v_cache = kv_cache
    t, hq, d = q.shape
    if t == 0:
        return q, k
    args = (
        q.data_ptr(), q.stride(0), hq, k.data_ptr(), k.stride(0), k.shape[1], d,
        cos.data_ptr(), sin.data_ptr(), t, torch.get_num_threads(), v.data_ptr(), v.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), k_cache.shape[0],
    )  # fmt: skip
    fn = _functions()[(q.dtype, "cache")]
    if torch.autograd._profiler_enabled():
        with record_function("batchgen::rotary_embedding_and_cache"):
            rc = fn(*args)
    else:
        rc = fn(*args)
    if rc == 2:
        raise ValueError(
            f"slot_mapping has a slot outside [0, {k_cache.shape[0]}) (min "
            f"{int(slot_mapping.min())}, max {int(slot_mapping.max())}); nothing was written"
        )
    if rc != 0:
        raise RuntimeError(f"rotary kernel rejected q {tuple(q.shape)}, k {tuple(k.shape)}")
    return q, k
