"""Argument checks of the fused MoE CPU kernel (`batchgen.kernels.fused_moe.fused_moe_silu`):
the kernel reads its tensors by ``data_ptr`` as dense CPU blocks, so every shape, dtype, device
and layout it relies on is checked here first, each failure naming the argument."""

from __future__ import annotations

import torch

PANEL = 16  # output columns per packed weight panel (the micro-kernel's width)


def check_fused_moe_args(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    topk_weights: torch.Tensor,
    order: torch.Tensor,
    counts,
) -> tuple[int, int, int]:
    """``(E, H, I)`` of the packed weights of `batchgen.kernels.fused_moe.fused_moe_silu`'s
    arguments (see there for their shapes).

    Raises:
        ValueError: unless the arguments describe one layer consistently, on the CPU, with
            contiguous packed weights and top_k >= 1 (the kernel trusts them: a wrong count or
            a strided weight would read past the weights or leave stale rows in the
            workspace). Whether ``order`` is a permutation the kernel checks itself (return
            code 3): a pass over it in C++ costs nothing next to the call.
    """
    named = {"x": x, "w13_packed": w13_packed, "w2_packed": w2_packed,
             "topk_weights": topk_weights, "order": order}
    for name, t in named.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    rank = 5 if x.dtype == torch.bfloat16 else 4
    if w13_packed.dim() != rank or w2_packed.dim() != rank:
        raise ValueError(
            f"w13_packed and w2_packed must come from pack_expert_weights ({rank}-D for {x.dtype})"
        )
    if w13_packed.dtype != x.dtype or w2_packed.dtype != x.dtype:
        raise ValueError(
            f"x ({x.dtype}), w13_packed ({w13_packed.dtype}) and w2_packed ({w2_packed.dtype}) "
            "must have one dtype"
        )
    for name in ("w13_packed", "w2_packed"):  # read by data_ptr as one dense block
        if not named[name].is_contiguous():
            raise ValueError(f"{name} must be contiguous (as pack_expert_weights returns it)")
    pair = 2 if rank == 5 else 1  # k per packed row
    num_experts = w13_packed.shape[0]
    hidden, inter = w13_packed.shape[2] * pair, w2_packed.shape[2] * pair
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
    if topk_weights.shape[1] < 1:
        raise ValueError("top_k (topk_weights.shape[1]) must be at least 1, got 0")
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
    return num_experts, hidden, inter
