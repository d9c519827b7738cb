"""The two steps every routed-expert path shares, so that they agree bit for bit: sorting
token activations by expert (`sort_by_expert`) and the slot-order float32 top-k sum
(`sum_slots`). A leaf module: the expert paths (`batchgen.models.layers.moe`,
`batchgen.models.layers.moe_cpu`, `batchgen.kernels.grouped_moe`) import it, it imports none
of them.

Shape legend: T = num_tokens, H = hidden_size, E = num_experts, A = num_experts_per_tok (top-k).
"""

from __future__ import annotations

import torch

from batchgen.kernels.moe_routing import moe_sort, moe_sort_available


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Order token activations by expert.

    Returns ``order [T*A]`` (indices into the flattened ``topk_ids``, grouped by expert, stable)
    and ``counts`` (a Python list of E rows-per-expert). Example: topk_ids = [[2, 0], [0, 1]]
    flattens to [2, 0, 0, 1]; order = [1, 2, 3, 0]; counts = [2, 1, 1].
    On CPU one counting-sort call (`batchgen.kernels.moe_routing.moe_sort`, the same result),
    else argsort and bincount.
    """
    if moe_sort_available(topk_ids):
        order, counts = moe_sort(topk_ids, num_experts)
        return order, counts.tolist()
    flat = topk_ids.reshape(-1)  # [T*A]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def route_rows(
    topk_ids: torch.Tensor, num_experts: int, stats
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """`sort_by_expert` plus the source token of each sorted activation (``order // A``,
    ``[T*A]``); records the rows per expert in ``stats`` when given."""
    order, counts = sort_by_expert(topk_ids, num_experts)
    if stats is not None:
        stats.record(counts)
    return order, counts, order // topk_ids.shape[1]




def sum_slots(pairs: torch.Tensor) -> torch.Tensor:
    """``pairs [T, K, H]`` -> ``[T, H]`` float32: ``((y_0 + y_1) + y_2) + ...`` in slot order,
    exactly the fused CPU kernel's last pass (``csrc/fused_moe.cpp``). Every expert path sums
    this way, so a token's result does not depend on which experts ran where, on how many
    threads, or on which rank (expert parallelism combines with it too)."""
    out = pairs[:, 0].to(torch.float32, copy=True)
    for a in range(1, pairs.shape[1]):
        out += pairs[:, a]
    return out


