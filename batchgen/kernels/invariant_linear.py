"""Batch-invariant linear layers for CPU float32 (``csrc/invariant_linear.cpp``).

``F.linear`` on CPU is MKL's SGEMM, whose code path and blocking of the reduction depend on the
number of rows M: the same row computed in calls of different M differs in the last bits
(measured on this project's machines with torch 2.13: M = 1 against M >= 2 for every shape
tried, M = 2 against M >= 3 at K = 64, M < 16 against M >= 16 at K = 512). Through the
logits that makes a request's tokens depend on its batch mates. `invariant_linear` computes
each output as one sequential sum over k whatever M, the row's place, the split over threads
or the number of threads (the micro-kernel of `batchgen.kernels.fused_moe`), so a row's result
depends only on the row and the weight. It is the GEMM of the engine's batch-invariant mode
(`EngineConfig.batch_invariant`, `batchgen.models.batch_invariant`).

Where the kernel is unavailable (not built, ``BATCHGEN_CPU_KERNELS`` without
``invariant_linear``, no AVX2/FMA, not float32) `invariant_linear` falls back to one
``F.linear`` call per row: every call then has the same shape ``[1, K]``, so it is invariant
too, and slow.

Cost: the packed weight is a second copy of the weight (`pack_linear_weight`).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from batchgen.kernels.cpu_build import kernels_enabled, load_library

PANEL = 16  # output columns per packed panel (the micro-kernel's width)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_fn = None


def _function():
    """The kernel function, or None while unavailable (not built, kernels off, no AVX2/FMA)."""
    global _fn
    if _fn is None:
        lib = load_library("invariant_linear")
        if lib is None or not lib.batchgen_invariant_linear_supported():
            return None
        fn = lib.batchgen_invariant_linear_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr] * 3 + [_i64] * 4
        _fn = fn
    return _fn


def invariant_kernel_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the kernel serves ``x @ weight.T``: CPU, both float32, the kernel built."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and kernels_enabled("invariant_linear")
        and _function() is not None
    )


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` -> ``[ceil(N / 16), K, 16]`` float32, contiguous: 16-column panels
    stored k-major, the last one padded with zero columns. A copy."""
    n, k = weight.shape
    padded = -(-n // PANEL) * PANEL
    w = weight.detach().float()
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    return w.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every row's result independent of the other rows.

    Args:
        x: ``[..., K]``; weight: ``[N, K]``; bias: ``[N]`` or None.
        packed: `pack_linear_weight` of ``weight`` (packed here, per call, when None).
    Returns:
        ``[..., N]`` in x's dtype. Each output is ``sum_k x[k] * w[n, k]`` in the order
        k = 0 .. K-1 (the kernel), or one ``[1, K]`` ``F.linear`` per row (the fallback); the
        two paths round differently, so one process should keep to one of them.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)  # [M, K]
    n = weight.shape[0]
    if not invariant_kernel_available(rows, weight):  # one [1, K] call per row
        out = rows.new_empty(0, n)
        if rows.shape[0]:
            out = torch.cat([F.linear(r, weight) for r in rows.split(1)])
    else:
        packed = pack_linear_weight(weight) if packed is None else packed
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], packed.shape[0] * PANEL, dtype=torch.float32)
        if rows.shape[0]:
            with record_function("batchgen::invariant_linear"):
                rc = _function()(
                    rows.data_ptr(),
                    packed.data_ptr(),
                    out.data_ptr(),
                    rows.shape[0],
                    k,
                    out.shape[1],
                    torch.get_num_threads(),
                )
            if rc != 0:
                raise RuntimeError(f"invariant linear kernel rejected the shapes (code {rc})")
        out = out[:, :n]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, n)
