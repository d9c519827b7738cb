"""The MoE layer under expert parallelism: route here, run each (token, slot) pair on the rank
that holds its expert, sum the weighted outputs here.

Shape legend: T = tokens of this rank at the layer, K = top-k, H = hidden, R = pairs received.

    topk_weights, topk_ids = block.route(x)                    # [T, K], replicated router
    recv = dispatcher.dispatch(x, topk_ids, topk_weights)      # pairs to their owners
    y = block.experts(recv.hidden, recv.weights[:, None], slots[:, None])   # [R, H] weighted
    out = dispatcher.combine(y, recv.handle)                   # [T, H], slots in order

Each received pair runs as a row of top-k 1 on the held experts, so on the fused CPU kernel its
weighted output is bit-for-bit the single-process kernel's value for that (token, slot), and
the combine adds the slots in the kernel's order: the layer's result equals one process's.

``local_rows`` (the ``data_parallel_offload`` prefill): those rows are not dispatched; their
pairs run here, on the held experts or on the other experts streamed in for this layer by
`ExpertWeightStreamer`, and are summed here (`sum_slots`). The dispatch and combine still
happen (with the remaining rows, possibly none), so every rank issues the same collectives.
"""

from __future__ import annotations

import torch

from batchgen.distributed.all_to_all import AllToAllDispatcher
from batchgen.distributed.deepep_dispatcher import DeepEPDispatcher
from batchgen.distributed.layout import ExpertPlacement
from batchgen.kernels.fused_moe import fused_moe_silu
from batchgen.models.layers.moe import (
    SparseMoeBlock,
    fused_experts_reference,
    sort_by_expert,
    sum_slots,
)


class ExpertParallelMoE:
    """Installed as ``SparseMoeBlock.expert_parallel`` on every MoE layer of a rank.

    Args:
        layer: the decoder layer index (for the streamer).
        dispatcher: the expert-parallel group's dispatcher (`AllToAllDispatcher`, or
            `DeepEPDispatcher` on CUDA with DeepEP: `rank.RankContext.install` picks).
        placement: logical expert -> owner / slot.
        ep_rank: this rank's index in the group.
        streamer: an `ExpertWeightStreamer` (None without ``data_parallel_offload``).
    """

    def __init__(
        self,
        layer: int,
        dispatcher: AllToAllDispatcher | DeepEPDispatcher,
        placement: ExpertPlacement,
        ep_rank: int,
        streamer=None,
    ) -> None:
        self.layer, self.dispatcher, self.placement = layer, dispatcher, placement
        self.ep_rank, self.streamer = ep_rank, streamer

    def __call__(
        self, block: SparseMoeBlock, x: torch.Tensor, local_rows: torch.Tensor | None
    ) -> torch.Tensor:
        topk_weights, topk_ids = block.route(x)  # [T, K]
        send_ids = topk_ids
        if local_rows is not None and local_rows.numel():
            send_ids = topk_ids.clone()
            send_ids[local_rows] = -1  # computed here, not dispatched
        recv = self.dispatcher.dispatch(x, send_ids, topk_weights)
        slots = self.placement.local_slot.to(x.device).index_select(0, recv.expert_ids)  # [R]
        # [R, H] float32: each pair's weighted output, rounded only after the slots are summed
        y = block.experts(recv.hidden, recv.weights[:, None], slots[:, None], torch.float32)
        out = self.dispatcher.combine(y, recv.handle)  # [T, H] float32
        if local_rows is not None and local_rows.numel():
            pairs = self._run_local_rows(block, x, topk_weights, topk_ids, local_rows)
            out[local_rows] = sum_slots(pairs)  # these tokens had no pair dispatched
        return out.to(x.dtype)  # [T, H]

    def _run_local_rows(self, block, x, topk_weights, topk_ids, local_rows) -> torch.Tensor:
        """``[L, K, H]`` float32: every slot's weighted output for ``local_rows [L]``, computed
        here: held experts from the block's own weights, the others from the streamer's
        buffers."""
        k = topk_ids.shape[1]
        ids = topk_ids.index_select(0, local_rows).reshape(-1)  # [L*K] logical experts
        weights = topk_weights.index_select(0, local_rows).reshape(-1)  # [L*K]
        rows = x.index_select(0, local_rows).repeat_interleave(k, dim=0)  # [L*K, H]
        owner = self.placement.owner.to(x.device).index_select(0, ids)
        out = torch.empty(ids.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        held = (owner == self.ep_rank).nonzero().squeeze(1)
        if held.numel():
            slots = self.placement.local_slot.to(x.device).index_select(0, ids[held])
            out[held] = block.experts(
                rows.index_select(0, held), weights[held, None], slots[:, None], torch.float32
            )
        other = (owner != self.ep_rank).nonzero().squeeze(1)
        weights_streamed = self.streamer.acquire(self.layer)  # waits for the prefetch
        try:
            if other.numel():
                slots = self.streamer.slot_of.to(x.device).index_select(0, ids[other])
                out[other] = run_streamed_experts(
                    block,
                    weights_streamed,
                    rows.index_select(0, other),
                    weights[other],
                    slots,
                ).to(out.dtype)
        finally:
            self.streamer.release(self.layer)
        return out.view(local_rows.shape[0], k, x.shape[1])


def run_streamed_experts(
    block: SparseMoeBlock,
    streamed: tuple[torch.Tensor, torch.Tensor],
    x: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Rows ``x [N, H]``, each on one streamed expert (``slots [N]`` into the buffers) weighted
    by ``weights [N]`` -> ``[N, H]``. ``streamed`` is ``(w13, w2)`` packed for the fused kernel
    when the block uses it (`SparseMoeBlock.uses_kernel`), else ``[E_s, 2I, H]`` /
    ``[E_s, H, I]``."""
    w13, w2 = streamed
    if block.uses_kernel(x):
        order, counts = sort_by_expert(slots[:, None], w13.shape[0])
        if block.stats is not None:
            block.stats.record(counts)
        return fused_moe_silu(x, w13, w2, weights[:, None], order, counts)
    return fused_experts_reference(
        x, w13, w2, weights[:, None], slots[:, None], block.act, block.stats, torch.float32
    )
