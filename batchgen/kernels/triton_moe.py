"""Routed experts as two Triton fused-MoE GEMMs (vLLM's ``fused_moe`` design): a CUDA path
beside `batchgen.kernels.grouped_moe`, and the one that runs where ``torch._grouped_mm`` has no
fast kernel (fp16, fp32, GPUs other than Hopper / Blackwell).

Steps (STYLE's "MoE as named steps"):

1. align (`moe_align_block_size`): token activations sorted by expert, each expert's rows
   padded to a multiple of BLOCK_M, so that every BLOCK_M row block belongs to one expert:
   ``sorted_token_ids`` (flat indices ``t * A + a``, padding = R), ``expert_ids`` (one per
   block) and ``num_tokens_post_padded``. Plain torch ops, no host synchronisation.
2. gate/up: ONE launch of `fused_moe_gemm_kernel` over all experts' blocks, ``x [T, H]`` rows
   gathered through ``sorted_token_ids // A`` times ``w13[e] [2I, H]^T`` -> ``[R, 2I]``,
   rounded to x's dtype.
3. SiLU-and-mul (`silu_and_mul_kernel`; another activation runs in torch) -> ``[R, I]``.
4. down: ONE launch, ``[R, I]`` times ``w2[e] [H, I]^T``, rounded to x's dtype, then widened
   and multiplied by the router weight in float32 (``MUL_ROUTED_WEIGHT``) -> ``[R, H]`` float32
   at the activations' flat indices (already in (token, slot) order: no un-sort).
5. top-k combine: `sum_slots` (float32, slot order), cast once.

The rounding points are those of `batchgen.models.layers.moe.fused_experts_reference`, so the
two differ only by the order in which a GEMM sums its K terms (and by ``exp`` in SiLU).

Shape legend: T = num_tokens, H = hidden_size, E = num_experts, A = num_experts_per_tok (top-k),
I = moe_intermediate_size, R = T*A token activations.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (numpy), which is how the tests
prove them on a machine without a GPU; triton 3.9's interpreter rounds float32 to bfloat16
wrongly (see ``tests/test_triton_kernels.py``), so bf16 is proven on a GPU only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.kernels.triton_support import triton_unsupported_reason
from batchgen.models.layers.moe_sort import sum_slots

def default_config(num_rows: int, num_experts: int) -> dict:
    """Tile sizes for R = ``num_rows`` activations over ``num_experts``: BLOCK_M follows the
    mean rows per expert (16 for decode-sized batches, 32, then 64; padding waste is at most
    BLOCK_M - 1 rows per expert); BLOCK_N 64, BLOCK_K 32 as vLLM's untuned default (which
    takes BLOCK_M 16 for small batches, else 64). Unmeasured on a GPU; the kernel has no
    grouped ordering of its programs for L2 reuse (vLLM's ``GROUP_SIZE_M``)."""
    mean_rows = num_rows / max(num_experts, 1)
    block_m = 16 if mean_rows <= 16 else 32 if mean_rows <= 64 else 64
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token activations by expert and pad each expert's rows to a multiple of
    ``block_m`` (vLLM's ``moe_align_block_size``, here in torch ops without host sync).

    Args:
        topk_ids: ``[T, A]`` int in ``[0, E)``; block_m: rows per tile; num_experts: E.
    Returns:
        ``sorted_token_ids [P]`` int32: flat activation indices ``t * A + a``, grouped by
        expert in ascending order, stable within an expert, each expert's run padded with R
        (= T*A) to a multiple of ``block_m``; ``P = ceil((R + min(E, R) * (block_m - 1)) /
        block_m) * block_m``, the most any routing needs. ``expert_ids [P // block_m]`` int32:
        the expert of each block (blocks past the padded rows in use repeat E - 1; the
        kernel skips them). ``num_tokens_post_padded [1]`` int32: the padded rows in use.

    Example: topk_ids = [[2, 0], [0, 1]] (flat [2, 0, 0, 1]), block_m = 2, E = 3: expert 0 has
    rows [1, 2], expert 1 [3, pad], expert 2 [0, pad] -> sorted_token_ids = [1, 2, 3, 4, 0, 4,
    4, 4, ...], expert_ids = [0, 1, 2, 2, ...], num_tokens_post_padded = [6].
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # [R]
    num_rows, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] (bincount would sync on CUDA)
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_ends = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # [R]
    sorted_experts = flat.index_select(0, order)  # [R]
    rank = torch.arange(num_rows, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (padded_ends - padded)[sorted_experts] + rank  # [R] row in the padded order
    max_blocks = -(-(num_rows + min(num_experts, num_rows) * (block_m - 1)) // block_m)
    sorted_token_ids = torch.full(
        (max_blocks * block_m,), num_rows, dtype=torch.int32, device=device
    )
    sorted_token_ids[dest] = order.to(torch.int32)
    blocks = torch.arange(max_blocks, device=device)
    expert_ids = torch.searchsorted(padded_ends // block_m, blocks, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)  # [P // block_m]
    return sorted_token_ids, expert_ids, padded_ends[-1:].to(torch.int32)


def _gemm(a, b, c, topk_weights, align, a_div, mul_routed_weight, config) -> None:
    """One launch of `fused_moe_gemm_kernel`: ``c[r] = a[r // a_div] @ b[expert(r)]^T``."""
    from batchgen.kernels import triton_moe_kernels as kernels

    sorted_token_ids, expert_ids, num_tokens_post_padded = align
    n, k = b.shape[1], b.shape[2]
    block_n = config["BLOCK_N"]
    grid = (expert_ids.shape[0] * -(-n // block_n),)
    kernels.fused_moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, c.shape[0], a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_DIV=a_div,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        ROUND_TO=kernels.TL_DTYPES[a.dtype],
        DOT_PRECISION=kernels.dot_precision(a.dtype),
        **config,
    )  # fmt: skip


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act=F.silu,
    stats=None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Routed experts with one Triton GEMM launch for gate/up and one for down.

    Args:
        x: ``[T, H]`` float32, float16 or bfloat16; w13: ``[E, 2I, H]`` (gate rows, then up
        rows); w2: ``[E, H, I]``, both of x's dtype and device; topk_weights: ``[T, A]``
        float32; topk_ids: ``[T, A]`` int in ``[0, E)``; act: the gate activation (SiLU runs
        in a Triton kernel, any other in torch); stats: optional recorder with
        ``record_device(counts)`` (`ExpertGemmStats`: the rows per expert stay on the
        device, no host sync); out_dtype: the result's
        dtype (default x's); config: tile sizes ``BLOCK_M/N/K`` (default `default_config`).
    Returns:
        ``[T, H]``: ``sum_a topk_weights[t, a] * expert_{topk_ids[t, a]}(x[t])``, weighted and
        summed over the slots in float32 in slot order (`sum_slots`), cast once: the arguments,
        rounding points and result of `fused_experts_reference`.
    Raises:
        ValueError: mixed dtypes or devices, mismatched shapes, or a device / dtype the kernels
        cannot run (`triton_unsupported_reason`).
    """
    if not x.dtype == w13.dtype == w2.dtype:
        raise ValueError(
            f"Triton experts need one dtype: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
        )
    if not x.device == w13.device == w2.device == topk_ids.device == topk_weights.device:
        raise ValueError("x, w13, w2, topk_weights and topk_ids must be on one device")
    reason = triton_unsupported_reason(x.device, x.dtype)
    if reason is not None:
        raise ValueError(f"Triton experts cannot run: {reason}")
    num_experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)} (want [E, 2I, H]), "
            f"w2 {tuple(w2.shape)} (want [E, H, I])"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != x.shape[:1]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T={x.shape[0]}, A]"
        )
    num_tokens, top_k = topk_ids.shape
    if stats is not None:  # counted on the device, read by the engine after sampling
        flat = topk_ids.reshape(-1).to(torch.int64)  # [R]
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        stats.record_device(counts.scatter_add_(0, flat, torch.ones_like(flat)))  # [E]
    if num_tokens == 0:
        return x.new_zeros(0, hidden, dtype=out_dtype or x.dtype)
    num_rows, inter = num_tokens * top_k, two_inter // 2
    config = config or default_config(num_rows, num_experts)
    align = moe_align_block_size(topk_ids, config["BLOCK_M"], num_experts)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [R]
    gate_up = x.new_empty(num_rows, two_inter)  # [R, 2I] at flat indices
    _gemm(x, w13, gate_up, weights, align, top_k, False, config)
    if act is F.silu:
        from batchgen.kernels import triton_moe_kernels as kernels

        hidden_act = x.new_empty(num_rows, inter)  # [R, I]
        block = min(1024, 1 << max(inter - 1, 1).bit_length())
        grid = (num_rows, -(-inter // block))
        kernels.silu_and_mul_kernel[grid](
            gate_up, hidden_act, inter, gate_up.stride(0), hidden_act.stride(0), BLOCK=block
        )
    else:
        gate, up = gate_up.chunk(2, dim=-1)  # [R, I] each
        hidden_act = (act(gate) * up).contiguous()
    y = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)  # [R, H]
    _gemm(hidden_act, w2, y, weights, align, 1, True, config)
    return sum_slots(y.view(num_tokens, top_k, hidden)).to(out_dtype or x.dtype)  # [T, H]
