"""Expert-parallel dispatch and combine: send each (token, slot) activation to the rank that owns
its expert, bring the weighted expert outputs back and sum them per token.

Shape legend: T = tokens on this rank, K = top-k, H = hidden, P = (token, slot) pairs this rank
sends, R = pairs it receives, W = ranks in the expert-parallel group.

    recv = dispatcher.dispatch(hidden [T, H], topk_ids [T, K], topk_weights [T, K])
    # recv.hidden [R, H], recv.expert_ids [R] (logical ids, all owned here), recv.weights [R]
    out = dispatcher.combine(expert_out [R, H], recv.handle)   # [T, H]

`AllToAllDispatcher` is the reference (DESIGN.md): sort the pairs by owner rank, exchange counts
with ``all_to_all_single``, then the payload with split sizes (each token's row once per owner
rank, its pairs as metadata); the owner multiplies each expert
output by its router weight and ``combine`` returns the rows and sums each token's slots in slot
order, the order of the single-process CPU kernel, so with that kernel the result is bit-for-bit
the single-process one. `AllGatherDispatcher` (vLLM's naive all-gather / reduce manager) is an
independent oracle for tests. Every rank must call ``dispatch`` and ``combine`` of a layer, with
zero rows if it has no tokens (DESIGN.md: the hang of vLLM #43547, SGLang #28915).

A ``topk_ids`` entry of -1 (DeepEP's convention) is a pair that is not dispatched; it adds
nothing in `combine` (the streamed-prefill path computes those tokens itself).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from batchgen.distributed.layout import ExpertPlacement
from batchgen.distributed.transport import GlooAllToAll
from batchgen.models.layers.moe import sum_slots  # noqa: F401 (re-exported: combine's order)


def sum_pairs(
    rows: torch.Tensor, flat_index: torch.Tensor, num_tokens: int, top_k: int
) -> torch.Tensor:
    """Rows of (token, slot) pairs -> ``[T, H]`` float32 per-token sums in slot order.

    Args:
        rows: ``[P, H]``; flat_index: ``[P]`` int64, ``token * top_k + slot`` of each row, each
            pair at most once.
    Returns:
        What `sum_slots` gives on the ``[T, K, H]`` tensor holding ``rows`` at their pairs and
        zeros elsewhere, bit for bit (up to the sign of a zero sum), without building it: one
        ``index_add_`` per slot, slot 0 first, so each token's value is
        ``((y_0 + y_1) + y_2) + ...`` as in the fused CPU kernel. (Building the zero-filled
        ``[T*K, H]`` tensor and scattering into it took half of a 1,024-token dispatch +
        combine on two gloo ranks.)
    """
    out = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    if flat_index.numel() == 0:
        return out
    slot, token = flat_index % top_k, flat_index // top_k
    for a in range(top_k):
        sel = (slot == a).nonzero().squeeze(1)
        if not sel.numel():
            continue
        tokens, part = token.index_select(0, sel), rows.index_select(0, sel)
        if part.dtype == torch.float32:
            out.index_add_(0, tokens, part)
        else:  # `sum_slots`'s mixed-dtype add: float32(out + y) computed in y's promotion
            out.index_copy_(0, tokens, out.index_select(0, tokens).add_(part))
    return out


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
    """All-to-all traffic of one rank.

    Attributes:
        bytes_sent: payload bytes sent to *other* ranks (rows to itself are not counted).
        seconds: in all collectives; wait_seconds: of those, in the first (tiny) exchange of
            each dispatch, which is mostly waiting for the slowest rank of the group to arrive.
        num_calls: collectives issued.
    """

    bytes_sent: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    num_calls: int = 0
    # (kind, enter, exit, bytes received) of every collective when tracing
    # (`rank.A2A_TRACE_ENV`): kind "counts" / "dispatch" / "combine", times
    # `time.monotonic_ns` (CLOCK_MONOTONIC is one clock for every process of a host, so the
    # ranks' traces line up).
    trace: list[tuple[str, int, int, int]] | None = None

    def add(
        self, nbytes: int, seconds: float, enter_ns: int = 0, kind: str = "", recv_bytes: int = 0
    ) -> None:
        self.bytes_sent += nbytes
        self.seconds += seconds
        self.num_calls += 1
        if self.trace is not None:
            self.trace.append((kind, enter_ns, enter_ns + int(seconds * 1e9), recv_bytes))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[N, C]`` of any dtype -> ``[N, C * itemsize]`` uint8, the same memory."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Rows travel as their bytes (``[N, C * itemsize]`` uint8, the same memory), so every
    dtype crosses every backend bit for bit: gloo's all-to-all refuses int16, for one."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


class AllToAllDispatcher:
    """Reference dispatch / combine over ``all_to_all_single`` (gloo on CPU, NCCL on CUDA).

    Args:
        group: the expert-parallel process group (None: the default group).
        placement: logical expert -> owner rank table (`ExpertPlacement`).
        stats: receives bytes and seconds (`CommStats`).
        transport: moves the rows (`transport.make_transport`; None: gloo on ``group``).
    """

    def __init__(
        self,
        group,
        placement: ExpertPlacement,
        stats: CommStats | None = None,
        transport=None,
    ):
        self.group = group
        self.transport = transport if transport is not None else GlooAllToAll(group)
        self.placement = placement
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.world != placement.ep_size:
            raise ValueError(
                f"the process group has {self.world} ranks but the placement {placement.ep_size}"
            )
        self.stats = stats if stats is not None else CommStats()
        self._owner: dict[torch.device, torch.Tensor] = {}
        # Tokens of every rank of the group in the current step (set by the rank loop after
        # the control exchange; None: unknown, exchange counts per dispatch).
        self.step_tokens: list[int] | None = None
        self.pad_rows = False

    def _owner_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._owner:
            self._owner[device] = self.placement.owner.to(device)
        return self._owner[device]

    def _exchange(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], kind: str
    ):
        """Rows of ``send`` (grouped by destination) -> rows received, grouped by source."""
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        enter = time.monotonic_ns()
        t0 = time.perf_counter()
        self.transport.all_to_all(_wire(recv), _wire(send.contiguous()), recv_counts, send_counts)
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        remote = sum(send_counts) - send_counts[self.rank]
        received = (sum(recv_counts) - recv_counts[self.rank]) * row_bytes
        self.stats.add(remote * row_bytes, time.perf_counter() - t0, enter, kind, received)
        return recv

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchResult:
        """Send every (token, slot) pair with ``topk_ids >= 0`` to its expert's owner.

        A token goes to each owner rank once, however many of its experts that rank holds
        (DeepEP does the same), as one row of bytes: its hidden state, then ``K`` int32 expert
        ids (-1 for slots that go elsewhere) and ``K`` float32 router weights. Two collectives
        per dispatch: the row counts, then the rows. The owner expands rows to pairs in
        (source rank, token, slot) order.

        Args:
            hidden: ``[T, H]``; topk_ids: ``[T, K]`` int64 logical experts (-1: not sent);
            topk_weights: ``[T, K]`` float32.
        Returns:
            The pairs this rank received (`DispatchResult`), grouped by source rank.
        """
        num_tokens, top_k = topk_ids.shape
        device, w = hidden.device, self.world
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        valid = (flat_ids >= 0).nonzero().squeeze(1)  # [P]
        experts = flat_ids.index_select(0, valid)
        dest = self._owner_on(device).index_select(0, experts)  # [P]
        # Pairs by destination, then token, then slot: valid is already in (token, slot) order.
        order = torch.argsort(dest, stable=True)
        pair_order = valid.index_select(0, order)  # [P]
        dest, experts = dest.index_select(0, order), experts.index_select(0, order)
        tokens = pair_order // top_k
        weights_sorted = topk_weights.reshape(-1).index_select(0, pair_order).float()
        tokens_of = self.step_tokens
        if tokens_of is not None and tokens_of[self.rank] == num_tokens and self.pad_rows:
            # Every rank's token count is known from the step's control exchange: send all T
            # rows to every rank (ids -1 where a slot goes elsewhere), receive T_src from each
            # source, and skip the count exchange (DeepEP's low-latency mode pads the same way).
            # Cheap when nearly every token has an expert on every rank (`pad_rows`).
            ids = torch.full((w, num_tokens, top_k), -1, dtype=torch.int32, device=device)
            ids[dest, tokens, pair_order % top_k] = experts.to(torch.int32)
            weights = torch.zeros(w, num_tokens, top_k, dtype=torch.float32, device=device)
            weights[dest, tokens, pair_order % top_k] = weights_sorted
            rows = hidden.unsqueeze(0).expand(w, -1, -1).reshape(w * num_tokens, hidden.shape[1])
            ids, weights = ids.view(w * num_tokens, top_k), weights.view(w * num_tokens, top_k)
            send_rows, recv_rows = [num_tokens] * w, list(tokens_of)
        else:
            # One row per (destination, token): a new row wherever the pair key changes.
            key = dest * max(num_tokens, 1) + tokens
            new_row = torch.ones_like(key, dtype=torch.bool)
            new_row[1:] = key[1:] != key[:-1]
            row_of_pair = torch.cumsum(new_row, 0) - 1  # [P] index into the rows sent
            num_rows = int(new_row.sum())
            ids = torch.full((num_rows, top_k), -1, dtype=torch.int32, device=device)
            ids[row_of_pair, pair_order % top_k] = experts.to(torch.int32)
            weights = torch.zeros(num_rows, top_k, dtype=torch.float32, device=device)
            weights[row_of_pair, pair_order % top_k] = weights_sorted
            rows = hidden.index_select(0, tokens[new_row])  # [U, H]
            send_rows_t = torch.bincount(dest[new_row], minlength=w)
            recv_rows_t = torch.empty_like(send_rows_t)
            enter = time.monotonic_ns()
            t0 = time.perf_counter()
            ones = [1] * w
            self.transport.all_to_all(recv_rows_t, send_rows_t, ones, ones)
            waited = time.perf_counter() - t0
            self.stats.add(0, waited, enter, "counts")
            self.stats.wait_seconds += waited
            send_rows, recv_rows = send_rows_t.tolist(), recv_rows_t.tolist()
        payload = torch.cat(
            [_bytes(rows), _bytes(ids), _bytes(weights)], dim=1
        )  # [rows, H * itemsize + 8K] uint8
        received = self._exchange(payload, send_rows, recv_rows, "dispatch")  # [U_r, bytes]
        hidden_bytes = rows.shape[1] * rows.element_size()
        r_rows = received[:, :hidden_bytes].view(hidden.dtype)  # [U_r, H]
        r_ids = received[:, hidden_bytes : hidden_bytes + 4 * top_k].view(torch.int32)
        r_weights = received[:, hidden_bytes + 4 * top_k :].view(torch.float32)
        row, col = (r_ids >= 0).nonzero(as_tuple=True)  # pairs in (source, token, slot) order
        source = torch.repeat_interleave(
            torch.arange(w, device=device), torch.tensor(recv_rows, device=device)
        ).index_select(0, row)
        send_pairs = torch.bincount(dest, minlength=w).tolist()
        recv_pairs = torch.bincount(source, minlength=w).tolist()
        handle = DispatchHandle(num_tokens, top_k, pair_order, send_pairs, recv_pairs)
        return DispatchResult(
            r_rows.index_select(0, row),
            r_ids[row, col].to(torch.long),
            r_weights[row, col],
            handle,
        )

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``expert_out [R, H]`` (weighted, in received order) -> ``[T, H]`` float32: the rows
        go back to their tokens' ranks, where each token's slots are summed in slot order
        (`sum_pairs`); pairs that were not dispatched add nothing."""
        back = self._exchange(
            expert_out, handle.recv_counts, handle.send_counts, "combine"
        )  # [P, H]
        return sum_pairs(back, handle.pair_order, handle.num_tokens, handle.top_k)


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
