"""Routed experts as two grouped GEMMs (`torch._grouped_mm`): the CUDA expert path.

Steps (STYLE's "MoE as named steps"): sort token activations by expert once
(`sort_by_expert`), then ONE grouped GEMM for gate/up over all experts, SiLU-and-mul (the
block's ``act``), ONE grouped GEMM for down, then the router weighting and the slot-order top-k
sum in float32 exactly as `batchgen.models.layers.moe.fused_experts_reference` does
(`sum_slots`), cast once.

Shape legend: T = num_tokens, H = hidden_size, E = num_experts, A = num_experts_per_tok (top-k),
I = moe_intermediate_size, R = T*A rows (token activations).

``torch._grouped_mm(mat_a [R, K], mat_b [E, K, N], offs=int32 [E]) -> [R, N]``: group e is rows
``offs[e-1]:offs[e]`` of ``mat_a`` times ``mat_b[e]``; ``offs`` holds the cumulative rows per
expert (an expert with no rows repeats the previous offset). The constraints, from PyTorch's
source (``aten/src/ATen/native/GroupedMMUtils.h``, ``cuda/GroupedBlas.cpp``, ``cuda/GroupMM.cu``,
``torch/_meta_registrations.py``; torch 2.13):

- dtypes: ``mat_a`` and ``mat_b`` bfloat16, float16 or float32; the output dtype must equal
  ``mat_a``'s (no float32 output for bf16 inputs yet), so each GEMM's output is rounded to bf16
  like `F.linear`'s.
- layouts: each operand either row-major or column-major in its last two dims, the other stride
  a multiple of 16 bytes (and on CUDA a 16-byte aligned data pointer). vLLM's ``w13_weight
  [E, 2I, H]`` enters as ``w13.transpose(-2, -1)`` (``[E, H, 2I]``, column-major: no copy), so H
  and I must be multiples of 8 in bf16/fp16 (4 in fp32) (`grouped_mm_unsupported_reason`).
- CUDA fast path (CUTLASS, float32 accumulation, no host sync): bf16 in and out on compute
  capability 9.0 (Hopper) or 10.x (``_scaled_mm_allowed_device(sm90_only, sm100_only)`` in
  ``_grouped_mm_cuda``), fewer than 1024 groups (``GroupMM.cu``). Anywhere else, float16
  included, torch runs ``_grouped_mm_fallback``: copies ``offs`` to the host and loops
  ``at::mm`` per group, no better than the reference loop, so `expert_path` picks the
  reference there.
- CPU: the same fallback (``at::mm_out`` per group, the GEMM `F.linear` runs), so on CPU this
  path equals the reference bit for bit (`tests/test_grouped_moe.py`); on CUDA CUTLASS and
  cuBLAS sum K in different orders, so there expect one bf16 rounding of a GEMM output apart.

vLLM's ``fused_moe`` Triton kernel and SGLang's ``moe_align_block_size`` pad each expert's rows
to the tile; ``_grouped_mm`` takes ragged rows directly (torchtitan's MoE pads only for the
2d-2d weight-gradient GEMM, which inference never runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.models.layers.moe_sort import sum_slots

# ``_grouped_mm``'s CUTLASS kernel refuses 1024 groups or more (``GroupMM.cu``).
GROUPED_MM_MAX_GROUPS = 1023
# Compute capabilities where ``_grouped_mm`` runs its CUTLASS kernel rather than a per-group loop.
GROUPED_MM_FAST_CAPABILITIES = ((9, 0), (10, None))


def grouped_mm_unsupported_reason(
    dtype: torch.dtype, hidden_size: int, intermediate_size: int, num_experts: int
) -> str | None:
    """Why `fused_experts_grouped_mm` cannot run experts of this shape, or None when it can.

    Checks ``torch._grouped_mm``'s existence, its dtypes (bf16, fp16, fp32), the 16-byte stride
    rule on the contraction dims (``hidden_size`` for gate/up, ``moe_intermediate_size`` for
    down) and the CUTLASS kernel's group limit."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype} (torch._grouped_mm takes bfloat16, float16, float32)"
    align = 16 // torch.empty((), dtype=dtype).element_size()
    for field, size in (("hidden_size", hidden_size), ("moe_intermediate_size", intermediate_size)):
        if size % align:
            return f"{field}={size} is not a multiple of {align} (16-byte strides for {dtype})"
    if num_experts > GROUPED_MM_MAX_GROUPS:
        return f"num_experts={num_experts} > {GROUPED_MM_MAX_GROUPS} groups"
    return None


def grouped_mm_fast_on(device: torch.device, dtype: torch.dtype) -> bool:
    """True where ``_grouped_mm`` runs its CUTLASS kernel: CUDA (not ROCm), bf16, compute
    capability 9.0 or 10.x (see the module docstring)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or torch.version.hip:
        return False
    if not hasattr(torch, "_grouped_mm"):
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return any(major == M and (m is None or minor == m) for M, m in GROUPED_MM_FAST_CAPABILITIES)


def fused_experts_grouped_mm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act=F.silu,
    stats=None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Routed experts with one grouped GEMM for gate/up and one for down.

    Args:
        x: ``[T, H]`` bf16 (fp16 / fp32 also run); w13: ``[E, 2I, H]`` (gate rows, then up rows);
        w2: ``[E, H, I]``, both of x's dtype; topk_weights: ``[T, A]`` float32; topk_ids:
        ``[T, A]`` int64 in ``[0, E)``; act: the gate activation; stats: optional recorder with
        ``record_device(counts)`` (`ExpertGemmStats`: the counts stay on the device); ``offs``
        is computed on the device, so the function syncs nowhere on CUDA's fast path
        (capturable in a CUDA graph); out_dtype: the result's dtype (default x's).
    Returns:
        ``[T, H]``: ``sum_a topk_weights[t, a] * expert_{topk_ids[t, a]}(x[t])``, weighted and
        summed over the slots in float32 in slot order (`sum_slots`), cast once: the arguments,
        rounding points and result of `fused_experts_reference`.
    Raises:
        ValueError: a shape or dtype `grouped_mm_unsupported_reason` names, or mixed dtypes.
    """
    num_experts = w13.shape[0]
    if not x.dtype == w13.dtype == w2.dtype:
        raise ValueError(
            f"grouped-GEMM experts need one dtype: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
        )
    reason = grouped_mm_unsupported_reason(x.dtype, x.shape[1], w2.shape[2], num_experts)
    if reason is not None:
        raise ValueError(f"grouped-GEMM experts cannot run: {reason}")
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)  # [R]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E]
    if stats is not None:  # on the device, read by the engine after sampling: no host sync
        stats.record_device(counts)
    if num_tokens == 0:
        return x.new_zeros(0, x.shape[1], dtype=out_dtype or x.dtype)
    # offs[e] = rows of experts 0..e: the end of expert e's rows in the sorted order, counted
    # on the device (no host sync: capturable in a CUDA graph).
    order = torch.argsort(flat, stable=True)  # [R], `sort_by_expert`'s order
    offs = counts.cumsum(0, dtype=torch.int32)  # [E]
    token_idx = order // top_k  # [R]
    x_sorted = x.index_select(0, token_idx)  # [R, H]
    gate_up = torch._grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offs)  # [R, 2I]
    gate, up = gate_up.chunk(2, dim=-1)  # [R, I] each
    y_sorted = torch._grouped_mm(act(gate) * up, w2.transpose(-2, -1), offs=offs)  # [R, H]
    y_sorted = y_sorted.float().mul_(topk_weights.reshape(-1).index_select(0, order)[:, None])
    y = y_sorted.index_select(0, torch.argsort(order))  # [R, H] in (token, slot) order
    return sum_slots(y.view(num_tokens, top_k, x.shape[1])).to(out_dtype or x.dtype)  # [T, H]
