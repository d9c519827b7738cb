"""Fused MoE experts for CPU float32 (``csrc/fused_moe.cpp``).

One call runs every expert of a layer: per expert, gather its rows, ``silu(x W1^T) * (x W3^T)``,
times ``W2^T``, weighted by the router; then each token's top-k outputs are summed in slot order.
The GEMMs use a register-blocked AVX2 micro-kernel on weights packed once (`pack_expert_weights`).
Against the per-expert torch path (`fused_experts_per_expert`: MKL GEMMs plus about eight small
ops per expert), on the bench model (E 64, H 512, I 256, top-8, 2 cores, one process, two
rounds each): 31.6 -> 10.5 ms per layer at 64 tokens, 68 -> 37 at 512, 88 -> 59 at 1,024,
150 -> 130 at 2,048, 290 -> 260 at 4,096 (`/tmp` scripts of session 5 on issue 4). The GEMM
alone matches MKL from 128 rows per expert and beats it below (one core: 29 vs 13-15 GFLOP/s
at 8 rows, 57 vs 51 at 64), where MKL packs the weight on every call.

The result equals `batchgen.models.layers.moe.fused_experts_reference` up to float32 rounding:
the same sums in the same top-k order, but each GEMM output is summed over k in one sequential
chain (relative error against float64 measured up to 2e-6 at K = 4,096 and 3e-6 at 7,168, 2-7x
MKL's blocked sums) and SiLU's ``exp`` is glibc's vector one (4.6 ULP worst case against
torch's 2.3). A token's output does not depend on the other tokens in the call.

Memory: the packed weights are a second copy of the expert weights, and the per-(token, slot)
scratch (`_workspace`) keeps the size of the largest call (T x top-k x H floats) for the life of
the process.
"""

from __future__ import annotations

import ctypes
import threading

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from batchgen.kernels.cpu_build import kernels_enabled, load_library

PANEL = 16  # output columns per packed weight panel (the micro-kernel's width)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_fn = None


def _function():
    """The kernel function, or None while unavailable (not built, kernels off, no AVX2/FMA)."""
    global _fn
    if _fn is None:
        lib = load_library("fused_moe")
        if lib is None or not lib.batchgen_fused_moe_supported():
            return None
        fn = lib.batchgen_fused_moe_silu_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr] * 8 + [_i64] * 6
        _fn = fn
    return _fn


_workspace_buffer: torch.Tensor | None = None
_workspace_lock = threading.Lock()


def _workspace(num_floats: int) -> torch.Tensor:
    """A float32 scratch buffer of ``num_floats`` reused across calls (grown when too small).

    The per-(token, slot) outputs of a coalesced step are large (16,384 tokens x top-8 x
    hidden 512 = 256 MiB), above glibc's largest mmap threshold (32 MiB), so a fresh tensor
    per call is fresh pages, faulted and zeroed every time (about 7% of the call at 4,096
    tokens). Callers hold `_workspace_lock` while they use it.
    """
    global _workspace_buffer
    if _workspace_buffer is None or _workspace_buffer.numel() < num_floats:
        _workspace_buffer = None  # free the old buffer before allocating the new one
        _workspace_buffer = torch.empty(num_floats, dtype=torch.float32)
    return _workspace_buffer[:num_floats]


def fused_moe_available(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act) -> bool:
    """True when `fused_moe_silu` serves this layer: CPU, float32 activations and weights, SiLU,
    ``2I`` and ``H`` multiples of `PANEL`, and the kernel built for this CPU."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and w13.dtype == torch.float32
        and w2.dtype == torch.float32
        and act is F.silu
        and w13.shape[1] % PANEL == 0
        and w2.shape[1] % PANEL == 0
        and kernels_enabled("fused_moe")
        and _function() is not None
    )


def pack_expert_weights(w: torch.Tensor) -> torch.Tensor:
    """``w [E, N, K]`` (rows = output features) -> ``[E, N / 16, K, 16]`` float32, contiguous:
    16-column panels, each stored k-major for the micro-kernel. A copy (N * K floats per
    expert). Raises ValueError when N is not a multiple of 16."""
    num_experts, n, k = w.shape
    if n % PANEL:
        raise ValueError(f"expert weight rows must be a multiple of {PANEL}, got {n}")
    return w.detach().float().view(num_experts, n // PANEL, PANEL, k).transpose(2, 3).contiguous()


def fused_moe_silu(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    topk_weights: torch.Tensor,
    order: torch.Tensor,
    counts: list[int],
) -> torch.Tensor:
    """Every expert of a SiLU-gated MoE layer in one kernel call.

    Args:
        x: ``[T, H]`` float32 activations.
        w13_packed: `pack_expert_weights` of ``w13 [E, 2I, H]`` (gate rows, then up rows).
        w2_packed: `pack_expert_weights` of ``w2 [E, H, I]``.
        topk_weights: ``[T, A]`` float32 router weights.
        order: ``[T * A]`` int64, the flat (token, slot) indices grouped by expert
            (`batchgen.models.layers.moe.sort_by_expert`).
        counts: rows per expert (length E, summing to T * A).
    Returns:
        ``[T, H]`` float32: ``sum_a topk_weights[t, a] * expert(x[t])``.
    Raises:
        ValueError: when the arguments' shapes disagree (named in the message).
        RuntimeError: when the kernel is unavailable or rejects the shapes.
    """
    fn = _function()
    if fn is None:
        raise RuntimeError("the fused MoE CPU kernel is not available")
    _check(x, w13_packed, w2_packed, topk_weights, order, counts)
    num_tokens, hidden = x.shape
    num_experts, top_k = len(counts), topk_weights.shape[1]
    inter = w2_packed.shape[2]
    out = torch.empty(num_tokens, hidden, dtype=torch.float32)
    if num_tokens == 0:
        return out
    x = x.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    order = order.to(torch.int64).contiguous()
    starts = torch.zeros(num_experts + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0, out=starts[1:])
    # The ctypes call is no torch op: name it, so torch.profiler (`batchgen bench --profile`)
    # shows its time instead of losing it.
    with _workspace_lock, record_function("batchgen::fused_moe_silu"):
        y_slots = _workspace(num_tokens * top_k * hidden)
        rc = fn(
            x.data_ptr(),
            w13_packed.data_ptr(),
            w2_packed.data_ptr(),
            weights.data_ptr(),
            order.data_ptr(),
            starts.data_ptr(),
            y_slots.data_ptr(),
            out.data_ptr(),
            num_tokens,
            hidden,
            inter,
            top_k,
            num_experts,
            torch.get_num_threads(),
        )
    if rc != 0:
        raise RuntimeError(f"fused MoE kernel rejected the shapes (code {rc})")
    return out


def _check(x, w13_packed, w2_packed, topk_weights, order, counts) -> None:
    """ValueError unless the arguments describe one layer consistently (the kernel trusts them:
    a wrong count would read past the weights or leave stale rows in the workspace)."""
    if w13_packed.dim() != 4 or w2_packed.dim() != 4:
        raise ValueError("w13_packed and w2_packed must come from pack_expert_weights (4-D)")
    num_experts, hidden, inter = w13_packed.shape[0], w13_packed.shape[2], w2_packed.shape[2]
    if w2_packed.shape[0] != num_experts or w2_packed.shape[1] * PANEL != hidden:
        raise ValueError(
            f"w2_packed {tuple(w2_packed.shape)} does not match w13_packed "
            f"{tuple(w13_packed.shape)}"
        )
    if w13_packed.shape[1] * PANEL != 2 * inter:
        raise ValueError(f"w13_packed rows {w13_packed.shape[1] * PANEL} != 2 x {inter}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [num_tokens, {hidden}], got {tuple(x.shape)}")
    if topk_weights.dim() != 2 or topk_weights.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_weights must be [{x.shape[0]}, top_k], got {tuple(topk_weights.shape)}"
        )
    if len(counts) != num_experts:
        raise ValueError(
            f"counts must have one entry per expert ({num_experts}), got {len(counts)}"
        )
    rows = topk_weights.numel()
    if order.numel() != rows or sum(counts) != rows or min(counts, default=0) < 0:
        raise ValueError(
            f"order ({order.numel()}) and counts (sum {sum(counts)}) must both cover the "
            f"{rows} (token, slot) rows"
        )
