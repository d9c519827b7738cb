"""RMSNorm on CPU in one kernel call (``csrc/rms_norm.cpp``), float32 and bfloat16.

`rms_norm` computes Hugging Face `LlamaRMSNorm`'s result (the order of operations and the
roundings of `batchgen.models.layers.norm.RMSNorm`'s eager ops) in one call instead of eight
torch ops; only the sum of squares is added in another order, so the mean can differ from
torch's in its last bit (tests/test_rms_norm.py bounds the outputs' difference). Where the
kernel does not serve (not CPU, other dtypes, weight of another dtype, gradients, the library
not built, ``BATCHGEN_CPU_KERNELS`` without ``rms_norm``, a weight that is not ``[H]``)
`rms_norm_available` is False and the caller runs the eager ops.

`fused_add_rms_norm` is vLLM's: the residual add (HF's ``residual + x`` in the model dtype) and
the norm of the sum in one call, bit for bit ``rms_norm(residual + x)`` of this kernel.
"""

from __future__ import annotations

import ctypes

import torch
from torch.profiler import record_function

from batchgen.kernels.cpu_build import kernels_enabled, load_library

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_fns: dict | None = None


def _functions() -> dict:
    """The kernel's entry points by dtype, the fused add's by ``(dtype, "add")``; empty while
    the library is unavailable."""
    global _fns
    if _fns is None:
        lib = load_library("rms_norm")
        fns: dict[torch.dtype, object] = {}
        if lib is not None:
            for dtype, name in (
                (torch.float32, "batchgen_rms_norm_f32"),
                (torch.bfloat16, "batchgen_rms_norm_bf16"),
            ):
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int
                fn.argtypes = [_ptr] * 3 + [_i64] * 2 + [ctypes.c_float, _i64]
                fns[dtype] = fn
                fused = getattr(lib, name.replace("rms_norm", "fused_add_rms_norm"))
                fused.restype = ctypes.c_int
                fused.argtypes = [_ptr] * 5 + [_i64] * 2 + [ctypes.c_float, _i64]
                fns[(dtype, "add")] = fused
        _fns = fns
    return _fns


def rms_norm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the kernel serves ``x [..., H]`` with ``weight [H]``: both on CPU, the same
    dtype (float32 or bfloat16), weight exactly ``[H]`` (the eager ops broadcast ``[1]`` or
    raise for other sizes; the kernel reads H weights), no gradient needed, the kernel built
    and enabled."""
    return (
        x.device.type == "cpu"
        and weight.shape == x.shape[-1:]
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and weight.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and kernels_enabled("rms_norm")
        and x.dtype in _functions()
    )


def _check_weight(x: torch.Tensor, weight: torch.Tensor, fn: str) -> None:
    """The checks of `rms_norm_available` the kernel's raw reads depend on (a shorter or
    other-dtype weight was read past its end or as other bits), for callers that skip it."""
    if (
        weight.shape != x.shape[-1:]
        or weight.dtype != x.dtype
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
    ):
        raise ValueError(
            f"{fn}: weight {tuple(weight.shape)} {weight.dtype} on {weight.device} must be "
            f"[H] of x's dtype (float32 or bfloat16) on the CPU, x is {tuple(x.shape)} "
            f"{x.dtype} on {x.device}"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * T(x32 / sqrt(mean(x32^2) + eps))`` over the last dimension, T = x's dtype.

    Args:
        x: ``[..., H]`` float32 or bfloat16 on CPU; weight: ``[H]``, same dtype;
        eps: added to the mean square (float32).
    Returns:
        ``[..., H]`` in x's dtype, a new tensor (empty, as from the eager ops, when x has no
        rows or H = 0).
    Raises:
        ValueError: weight not ``[H]`` of x's dtype, or a tensor off the CPU.
        RuntimeError: the kernel rejected the shapes.
    Call only where `rms_norm_available` is True."""
    _check_weight(x, weight, "rms_norm")
    h = x.shape[-1]
    if x.numel() == 0:  # reshape(-1, 0) cannot infer the rows
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    rows = x.reshape(-1, h).contiguous()
    w = weight.contiguous()
    out = torch.empty_like(rows)
    args = (rows.data_ptr(), w.data_ptr(), out.data_ptr(), rows.shape[0], h, eps)
    fn, threads = _functions()[x.dtype], torch.get_num_threads()
    if torch.autograd._profiler_enabled():  # the scope costs ~5 us even when not profiled
        with record_function("batchgen::rms_norm"):
            rc = fn(*args, threads)
    else:
        rc = fn(*args, threads)
    if rc != 0:
        raise RuntimeError(f"rms_norm kernel rejected the shape {tuple(x.shape)} (code {rc})")
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` (rounded to the dtype, as torch's add), then `rms_norm` of ``s``, in
    one kernel call (vLLM's ``fused_add_rms_norm``, out of place here).

    Args:
        x, residual: ``[..., H]`` of one shape and dtype (float32 or bfloat16) on CPU;
        weight: ``[H]``, same dtype; eps: as `rms_norm`.
    Returns:
        ``(normed, s)``: ``rms_norm(s, weight, eps)`` bit for bit, and the new residual ``s``,
        both new ``[..., H]`` tensors.
    Raises:
        ValueError: x and residual differ in shape, dtype or device; weight not ``[H]`` of
            x's dtype, or a tensor off the CPU.
        RuntimeError: the kernel rejected the shapes.
    Call only where `rms_norm_available(x, weight)` is True."""
    if x.shape != residual.shape or x.dtype != residual.dtype or residual.device != x.device:
        raise ValueError(
            f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} on "
            f"{residual.device} must match x {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    _check_weight(x, weight, "fused_add_rms_norm")
    h = x.shape[-1]
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format), residual + x
    x, residual = x.contiguous(), residual.contiguous()  # no-ops at decode: no reshape calls
    both = torch.empty((2, *x.shape), dtype=x.dtype)  # one allocation: normed, sum
    out, s = both[0], both[1]
    w = weight if weight.is_contiguous() else weight.contiguous()
    args = (x.data_ptr(), residual.data_ptr(), s.data_ptr(), w.data_ptr(), out.data_ptr())
    args += (x.numel() // h, h, eps, torch.get_num_threads())
    fn = _functions()[(x.dtype, "add")]
    if torch.autograd._profiler_enabled():
        with record_function("batchgen::fused_add_rms_norm"):
            rc = fn(*args)
    else:
        rc = fn(*args)
    if rc != 0:
        raise RuntimeError(f"fused_add_rms_norm rejected the shape {tuple(x.shape)} (code {rc})")
    return out, s
