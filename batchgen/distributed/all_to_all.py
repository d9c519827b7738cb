"""Expert-parallel dispatch and combine: send each (token, slot) activation to the rank that owns
its expert, bring the weighted expert outputs back and sum them per token.

Shape legend: T = tokens on this rank, K = top-k, H = hidden, P = (token, slot) pairs this rank
sends, R = pairs it receives, W = ranks in the expert-parallel group.

    recv = dispatcher.dispatch(hidden [T, H], topk_ids [T, K], topk_weights [T, K])
    # recv.hidden [R, H], recv.expert_ids [R] (logical ids, all owned here), recv.weights [R]
    out = dispatcher.combine(expert_out [R, H], recv.handle)   # [T, H]

`AllToAllDispatcher` is the reference (DESIGN.md): sort the pairs by owner rank, exchange counts
with ``all_to_all_single``, then the payload with split sizes; the owner multiplies each expert
output by its router weight and ``combine`` returns the rows and sums each token's slots in slot
order, the order of the single-process CPU kernel, so with that kernel the result is bit-for-bit
the single-process one. `AllGatherDispatcher` (vLLM's naive all-gather / reduce manager) is an
independent oracle for tests. Every rank must call ``dispatch`` and ``combine`` of a layer, with
zero rows if it has no tokens (DESIGN.md: the hang of vLLM #43547, SGLang #28915).

A ``topk_ids`` entry of -1 (DeepEP's convention) is a pair that is not dispatched; its row in
`combine_pairs` is zero (the streamed-prefill path fills those rows itself).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from batchgen.distributed.layout import ExpertPlacement


@dataclass
class DispatchHandle:
    """What `combine` needs to bring rows back.

    Attributes:
        num_tokens / top_k: T and K of the dispatching rank.
        pair_order: ``[P]`` int64 flat pair indices (``t * K + a``) in send order (grouped by
            destination rank).
        send_counts / recv_counts: rows sent to / received from each rank (length W).
    """

    num_tokens: int
    top_k: int
    pair_order: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]


@dataclass
class DispatchResult:
    """Rows received by this rank: ``hidden [R, H]``, ``expert_ids [R]`` int64 logical expert
    ids (all owned by this rank), ``weights [R]`` float32 router weights, and the handle."""

    hidden: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor
    handle: DispatchHandle


@dataclass
class CommStats:
    """All-to-all traffic of one rank: payload bytes sent and seconds spent in collectives."""

    bytes_sent: int = 0
    seconds: float = 0.0
    num_calls: int = 0
    per_layer: dict = field(default_factory=dict)

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes_sent += nbytes
        self.seconds += seconds
        self.num_calls += 1


def sum_slots(pairs: torch.Tensor) -> torch.Tensor:
    """``pairs [T, K, H]`` -> ``[T, H]`` float32: ``((y_0 + y_1) + y_2) + ...`` in slot order,
    exactly the fused CPU kernel's last pass (``csrc/fused_moe.cpp``)."""
    out = pairs[:, 0].to(torch.float32, copy=True)
    for a in range(1, pairs.shape[1]):
        out += pairs[:, a]
    return out


def _wire(t: torch.Tensor, group) -> torch.Tensor:
    """Half-precision rows travel as int16 on gloo (which has no bf16 collectives); same bits."""
    if t.dtype in (torch.bfloat16, torch.float16) and dist.get_backend(group) == "gloo":
        return t.view(torch.int16)
    return t


class AllToAllDispatcher:
    """Reference dispatch / combine over ``all_to_all_single`` (gloo on CPU, NCCL on CUDA).

    Args:
        group: the expert-parallel process group (None: the default group).
        placement: logical expert -> owner rank table (`ExpertPlacement`).
        stats: receives bytes and seconds (`CommStats`).
    """

    def __init__(self, group, placement: ExpertPlacement, stats: CommStats | None = None):
        self.group = group
        self.placement = placement
        self.world = dist.get_world_size(group)
        if self.world != placement.ep_size:
            raise ValueError(
                f"the process group has {self.world} ranks but the placement {placement.ep_size}"
            )
        self.stats = stats if stats is not None else CommStats()
        self._owner: dict[torch.device, torch.Tensor] = {}

    def _owner_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._owner:
            self._owner[device] = self.placement.owner.to(device)
        return self._owner[device]

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]):
        """Rows of ``send`` (grouped by destination) -> rows received, grouped by source."""
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        t0 = time.perf_counter()
        dist.all_to_all_single(
            _wire(recv, self.group),
            _wire(send.contiguous(), self.group),
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=self.group,
        )
        self.stats.add(send.numel() * send.element_size(), time.perf_counter() - t0)
        return recv

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchResult:
        """Send every (token, slot) pair with ``topk_ids >= 0`` to its expert's owner.

        Args:
            hidden: ``[T, H]``; topk_ids: ``[T, K]`` int64 logical experts (-1: not sent);
            topk_weights: ``[T, K]`` float32.
        Returns:
            The rows this rank received (`DispatchResult`), grouped by source rank.
        """
        num_tokens, top_k = topk_ids.shape
        device = hidden.device
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        valid = (flat_ids >= 0).nonzero().squeeze(1)  # [P]
        dest = self._owner_on(device).index_select(0, flat_ids.index_select(0, valid))  # [P]
        order = torch.argsort(dest, stable=True)
        pair_order = valid.index_select(0, order)  # [P] pairs grouped by destination
        send_counts_t = torch.bincount(dest, minlength=self.world)
        recv_counts_t = torch.empty_like(send_counts_t)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
        self.stats.add(send_counts_t.numel() * 8, time.perf_counter() - t0)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
        # Expert id and router weight travel together: [P, 2] int32 (the weight's bits).
        meta = torch.stack(
            [
                flat_ids.index_select(0, pair_order).to(torch.int32),
                topk_weights.reshape(-1).index_select(0, pair_order).float().view(torch.int32),
            ],
            dim=1,
        )
        recv_meta = self._exchange(meta, send_counts, recv_counts)  # [R, 2]
        send_hidden = hidden.index_select(0, pair_order // top_k)  # [P, H]
        recv_hidden = self._exchange(send_hidden, send_counts, recv_counts)  # [R, H]
        handle = DispatchHandle(num_tokens, top_k, pair_order, send_counts, recv_counts)
        return DispatchResult(
            recv_hidden,
            recv_meta[:, 0].to(torch.long),
            recv_meta[:, 1].contiguous().view(torch.float32),
            handle,
        )

    def combine_pairs(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``expert_out [R, H]`` (weighted, in received order) -> ``[T, K, H]`` at each pair's
        place on the dispatching rank; pairs that were not dispatched are zero."""
        back = self._exchange(expert_out, handle.recv_counts, handle.send_counts)  # [P, H]
        t, k = handle.num_tokens, handle.top_k
        pairs = back.new_zeros((t * k, back.shape[1]))
        pairs.index_copy_(0, handle.pair_order, back)
        return pairs.view(t, k, back.shape[1])

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``expert_out [R, H]`` -> ``[T, H]`` float32: each token's slots summed in slot
        order (`sum_slots`)."""
        return sum_slots(self.combine_pairs(expert_out, handle))


class AllGatherDispatcher:
    """Test oracle with the same interface: every rank gathers every rank's tokens and computes
    its experts' share for all of them; combine all-reduces the per-token sums (vLLM's naive
    all-gather / reduce-scatter manager; gloo has no reduce-scatter, so all-reduce and slice).
    Sums run in another order than the reference, so results agree to rounding, not bits."""

    def __init__(self, group, placement: ExpertPlacement, ep_rank: int):
        self.group, self.placement, self.ep_rank = group, placement, ep_rank
        self.world = dist.get_world_size(group)

    def _gather(self, t: torch.Tensor, max_rows: int) -> torch.Tensor:
        padded = t.new_zeros((max_rows, *t.shape[1:]))
        padded[: t.shape[0]] = t
        out = t.new_empty((self.world * max_rows, *t.shape[1:]))
        dist.all_gather_single(out, padded, group=self.group)
        return out

    def dispatch(self, hidden, topk_ids, topk_weights) -> DispatchResult:
        counts = torch.tensor([hidden.shape[0]], dtype=torch.long)
        all_counts = torch.empty(self.world, dtype=torch.long)
        dist.all_gather_single(all_counts, counts, group=self.group)
        sizes = all_counts.tolist()
        m = max(sizes)
        h = self._gather(hidden, m)  # [W*m, H]
        ids = self._gather(topk_ids, m)
        w = self._gather(topk_weights.float(), m)
        k = topk_ids.shape[1]
        real = torch.cat([torch.arange(r * m, r * m + n) for r, n in enumerate(sizes)])
        flat_ids = ids.index_select(0, real).reshape(-1)  # [N*K]
        owner = self.placement.owner
        mine = ((flat_ids >= 0) & (owner[flat_ids.clamp(min=0)] == self.ep_rank)).nonzero()
        mine = mine.squeeze(1)
        handle = DispatchHandle(hidden.shape[0], k, mine, sizes, [])
        tokens = real.index_select(0, mine // k)
        return DispatchResult(
            h.index_select(0, tokens),
            flat_ids.index_select(0, mine),
            w.index_select(0, real).reshape(-1).index_select(0, mine),
            handle,
        )

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        sizes, k = handle.send_counts, handle.top_k
        total = sum(sizes)
        partial = torch.zeros(total, expert_out.shape[1], dtype=torch.float32)
        partial.index_add_(0, handle.pair_order // k, expert_out.float())
        dist.all_reduce(partial, group=self.group)
        start = sum(sizes[: self.ep_rank])
        return partial[start : start + handle.num_tokens]
