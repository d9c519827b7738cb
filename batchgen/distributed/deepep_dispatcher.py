"""Expert-parallel dispatch / combine over DeepEP's normal-mode kernels (NVLink / RDMA, CUDA).

Shape legend: T = tokens on this rank, K = top-k, H = hidden, N = token rows DeepEP delivers
here (one per (source token, this rank), holding up to K of this rank's experts), R = (token,
slot) pairs received, L = DeepEP's experts per rank, W = ranks in the expert-parallel group.

Same interface as `AllToAllDispatcher` (`DispatchResult`: rows, logical expert ids owned here,
router weights), so `ExpertParallelMoE` does not know which one it has:

    recv = dispatcher.dispatch(hidden [T, H] bf16, topk_ids [T, K], topk_weights [T, K])
    out = dispatcher.combine(expert_out [R, H] (weighted), recv.handle)   # [T, H] float32

How DeepEP's layout maps onto ours (followed from DeepEP's source, ``deep_ep/buffers/legacy.py``
``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine``, ``csrc/kernels/legacy/intranode.cu``
``dispatch`` / ``combine``, and ``tests/legacy/test_intranode.py``; older releases keep the same
class in ``deep_ep/buffer.py``):

- DeepEP places experts in equal contiguous blocks: rank r owns ids ``[r*L, (r+1)*L)``. Our
  placement may be uneven (7 experts on 2 ranks), so each logical expert gets the DeepEP id
  ``owner * L + local_slot`` with ``L`` the largest per-rank count; the ids no expert takes
  receive no tokens.
- ``dispatch`` delivers one row per (token, destination rank), grouped by source rank, with
  ``recv_topk_idx [N, K]`` holding *local* expert indices (``id - r*L``) and -1 for slots owned
  elsewhere, and ``recv_topk_weights [N, K]`` with 0 in those slots. We expand every valid
  (row, slot) into a pair: its row, the logical expert of that local slot, its weight.
- ``combine`` adds the rows returned for a token (one per rank it went to) **without weights**
  in float32 and rounds to bf16. So before it we sum the weighted outputs of the pairs of each
  received row, in slot order (`sum_pairs`), and send one bf16 row per received token.

Numerics: DeepEP's combine is bf16 only, so each rank's per-token partial sum is rounded to bf16
before DeepEP adds the ranks' partials (in its own order) and rounds again. The reference rounds
once, after all slots; results agree to bf16 rounding, not bit for bit with one process.

Zero tokens: a rank with T = 0 dispatches one dummy row whose slots are all -1 (it goes
nowhere) and drops it after combine; a ``[0, K]`` ``topk_idx`` has made DeepEP assert on a null
pointer (SGLang PR #25397).

Not done here: the low-latency kernels (``low_latency_dispatch`` / ``combine``) for decode;
see docs/distributed.md.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from batchgen.distributed.all_to_all import CommStats, DispatchResult, sum_pairs
from batchgen.distributed.layout import ExpertPlacement

EP_DISPATCHER_ENV = "BATCHGEN_EP_DISPATCHER"
EP_DISPATCHER_CHOICES = ("auto", "deepep", "all_to_all")


@dataclass
class DeepEPHandle:
    """What `DeepEPDispatcher.combine` needs.

    Attributes:
        num_tokens: T of the dispatching rank (before the dummy row of an empty rank).
        top_k: K.
        num_recv_rows: N, the token rows DeepEP delivered here.
        num_remote_rows: of those, the rows from other ranks (for `CommStats`).
        pair_index: ``[R]`` int64 ``row * K + slot`` of every received pair, in the order of
            the rows of `DispatchResult`.
        deepep_handle: DeepEP's own handle (opaque tuple), for ``Buffer.combine``.
    """

    num_tokens: int
    top_k: int
    num_recv_rows: int
    num_remote_rows: int
    pair_index: torch.Tensor
    deepep_handle: object


@dataclass
class DeepEPTransport:
    """Stands where `AllToAllDispatcher.transport` does, for the rank's log and metrics."""

    name: str = "deepep"

    def close(self) -> None:
        """Nothing to close: DeepEP's ``Buffer`` frees its memory when it is collected."""


def import_deep_ep():
    """``import deep_ep`` -> the module.

    Raises:
        RuntimeError: naming why it failed (not installed; or its import-time NCCL / JIT
            checks failed, which DeepEP reports as AssertionError).
    """
    try:
        return importlib.import_module("deep_ep")
    except Exception as e:  # ImportError, or DeepEP's own import-time assertions
        raise RuntimeError(f"'import deep_ep' failed: {type(e).__name__}: {e}") from e


def check_deep_ep_supports(deep_ep, ep_size: int, dtype: torch.dtype) -> str | None:
    """Why DeepEP's normal kernels cannot serve this group (None: they can).

    DeepEP's combine kernel is bf16 only (``SWITCH_TYPES`` in ``csrc/kernels/legacy``), and it
    has tuned configs only for some group sizes (``Buffer.get_dispatch_config``: 2, 4, 8 within
    a node, multiples of 8 across nodes), asserting otherwise.
    """
    if dtype != torch.bfloat16:
        return f"DeepEP's combine takes bfloat16 only and the model runs in {dtype}"
    try:
        deep_ep.Buffer.get_dispatch_config(ep_size)
        deep_ep.Buffer.get_combine_config(ep_size)
    except AssertionError as e:
        return f"DeepEP has no dispatch/combine config for {ep_size} ranks ({e})"
    return None


def resolve_ep_dispatcher(
    device: torch.device, dtype: torch.dtype, ep_size: int, env: dict | None = None
) -> tuple[str, str]:
    """Which dispatcher an expert-parallel group uses: ``("deepep" | "all_to_all", why)``.

    ``$BATCHGEN_EP_DISPATCHER`` (default ``auto``): ``auto`` picks DeepEP when the device is
    CUDA, the group has more than one rank, ``import deep_ep`` works and DeepEP supports the
    group size and dtype (`check_deep_ep_supports`), else the ``all_to_all_single`` reference;
    ``all_to_all`` always picks the reference; ``deepep`` insists.

    Raises:
        ValueError: the variable holds another value.
        RuntimeError: ``deepep`` was asked for and cannot be used, with the reason.
    """
    env = os.environ if env is None else env
    choice = env.get(EP_DISPATCHER_ENV, "auto").strip().lower() or "auto"
    if choice not in EP_DISPATCHER_CHOICES:
        raise ValueError(
            f"{EP_DISPATCHER_ENV}={env.get(EP_DISPATCHER_ENV)!r}: expected one of "
            f"{', '.join(EP_DISPATCHER_CHOICES)}"
        )
    if choice == "all_to_all":
        return "all_to_all", f"{EP_DISPATCHER_ENV}=all_to_all"
    reason = None
    if torch.device(device).type != "cuda":
        reason = f"DeepEP needs CUDA devices and this rank runs on {torch.device(device).type}"
    elif ep_size < 2:
        reason = "the expert-parallel group has one rank"
    else:
        try:
            reason = check_deep_ep_supports(import_deep_ep(), ep_size, dtype)
        except RuntimeError as e:
            reason = str(e)
    if reason is None:
        return "deepep", "deep_ep imports on CUDA"
    if choice == "deepep":
        raise RuntimeError(f"{EP_DISPATCHER_ENV}=deepep but DeepEP cannot be used: {reason}")
    return "all_to_all", reason


class DeepEPDispatcher:
    """Dispatch / combine with DeepEP's normal-mode ``Buffer`` (see the module docstring).

    Args:
        group: the expert-parallel process group (None: the default group); DeepEP builds its
            buffer over it (a collective: every rank of the group constructs at once).
        placement: logical expert -> owner rank / local slot (`ExpertPlacement`).
        hidden_size: H, to size the buffer (``Config.get_nvl_buffer_size_hint`` /
            ``get_rdma_buffer_size_hint`` of the dispatch and combine configs, as DeepEP's
            README does, bf16 rows).
        stats: receives bytes and seconds (`CommStats`); seconds are host time, and combine
            may return before its kernel finishes on the GPU.
        deep_ep: the module (None: ``import deep_ep``); tests pass a CPU fake.
    Raises:
        ValueError: group and placement disagree on the rank count, or DeepEP cannot serve
            this group size (`check_deep_ep_supports`).
        RuntimeError: ``deep_ep`` does not import.
    """

    def __init__(
        self,
        group,
        placement: ExpertPlacement,
        hidden_size: int,
        stats: CommStats | None = None,
        deep_ep=None,
    ) -> None:
        self.deep_ep = deep_ep if deep_ep is not None else import_deep_ep()
        self.group, self.placement = group, placement
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if self.world != placement.ep_size:
            raise ValueError(
                f"the process group has {self.world} ranks but the placement {placement.ep_size}"
            )
        reason = check_deep_ep_supports(self.deep_ep, self.world, torch.bfloat16)
        if reason is not None:
            raise ValueError(reason)
        per_rank = [len(placement.experts_of(r)) for r in range(self.world)]
        self.num_local = max(per_rank)  # L
        self.num_deepep_experts = self.world * self.num_local
        # [E] logical expert -> DeepEP id (its owner's block of L ids, at its slot)
        self.deepep_id = placement.owner * self.num_local + placement.local_slot
        local = torch.full((self.num_local,), -1, dtype=torch.long)  # [L] local -> logical
        local[: per_rank[self.rank]] = torch.tensor(placement.experts_of(self.rank))
        self.local_logical = local
        self.topk_idx_dtype = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        self.buffer = self._make_buffer(hidden_size)
        self.stats = stats if stats is not None else CommStats()
        self.transport = DeepEPTransport()
        self.step_tokens: list[int] | None = None  # set by the rank loop; DeepEP needs none
        self.pad_rows = False

    def _make_buffer(self, hidden_size: int):
        buffer_cls = self.deep_ep.Buffer
        hidden_bytes = hidden_size * 2  # bf16 rows (README: H * max(element_size, 2))
        nvl_bytes = rdma_bytes = 0
        for config in (
            buffer_cls.get_dispatch_config(self.world),
            buffer_cls.get_combine_config(self.world),
        ):
            nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, self.world))
            rdma_bytes = max(
                rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, self.world)
            )
        return buffer_cls(self.group, nvl_bytes, rdma_bytes)

    def _on(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t if t.device == device else t.to(device)

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchResult:
        """Send each token once to every rank owning one of its experts (``topk_ids >= 0``).

        Args:
            hidden: ``[T, H]`` bfloat16; topk_ids: ``[T, K]`` int64 logical experts (-1: not
                sent); topk_weights: ``[T, K]`` float32 router weights.
        Returns:
            The pairs received (`DispatchResult`: ``hidden [R, H]`` bf16, ``expert_ids [R]``
            int64 logical ids owned here, ``weights [R]`` float32), grouped by source rank as
            DeepEP delivers them, then by slot within each received row.
        Raises:
            ValueError: ``hidden`` is not bfloat16, or shapes disagree.
        """
        if hidden.dtype != torch.bfloat16:
            raise ValueError(f"DeepEPDispatcher: hidden must be bfloat16, got {hidden.dtype}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"DeepEPDispatcher: hidden {tuple(hidden.shape)}, topk_ids "
                f"{tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} disagree"
            )
        num_tokens, top_k = topk_ids.shape
        device = hidden.device
        if num_tokens == 0:  # one dummy row going nowhere (module docstring)
            hidden = hidden.new_zeros(1, hidden.shape[1])
            topk_ids = torch.full((1, top_k), -1, dtype=torch.long, device=device)
            topk_weights = torch.zeros(1, top_k, dtype=torch.float32, device=device)
        ids = self._on(self.deepep_id, device).index_select(0, topk_ids.reshape(-1).clamp(min=0))
        ids = torch.where(topk_ids.reshape(-1) >= 0, ids, -1)
        ids = ids.view(topk_ids.shape).to(self.topk_idx_dtype).contiguous()  # [T, K] DeepEP ids
        enter, t0 = time.monotonic_ns(), time.perf_counter()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            ids, self.num_deepep_experts
        )
        recv_x, recv_idx, recv_weights, _, deepep_handle, _ = self.buffer.dispatch(
            hidden.contiguous(),
            topk_idx=ids,
            topk_weights=topk_weights.float().contiguous(),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        sent = per_rank.tolist()
        row_bytes = hidden.shape[1] * hidden.element_size()
        remote = (sum(sent) - sent[self.rank]) * row_bytes
        self.stats.add(remote, time.perf_counter() - t0, enter, "dispatch", 0)
        # [N, K] local slots -> pairs in (row, slot) order
        row, col = (recv_idx >= 0).nonzero(as_tuple=True)
        local = recv_idx[row, col].long()
        num_recv = recv_x.shape[0]
        from_others = num_recv - sent[self.rank]
        handle = DeepEPHandle(
            num_tokens, top_k, num_recv, from_others, row * top_k + col, deepep_handle
        )
        return DispatchResult(
            recv_x.index_select(0, row),
            self._on(self.local_logical, device).index_select(0, local),
            recv_weights[row, col].float(),
            handle,
        )

    def combine(self, expert_out: torch.Tensor, handle: DeepEPHandle) -> torch.Tensor:
        """``expert_out [R, H]`` (each pair's weighted output, in `dispatch`'s order) ->
        ``[T, H]`` float32 (bf16 values, see the module docstring): the pairs of each received
        row are summed in slot order, the row goes back as bf16 and DeepEP adds the rows of each
        token across ranks; tokens with no pair dispatched get zeros."""
        per_row = sum_pairs(expert_out, handle.pair_index, handle.num_recv_rows, handle.top_k)
        enter, t0 = time.monotonic_ns(), time.perf_counter()
        combined, _, _ = self.buffer.combine(per_row.to(torch.bfloat16), handle.deepep_handle)
        remote = handle.num_remote_rows * expert_out.shape[1] * 2  # bf16 rows to other ranks
        self.stats.add(remote, time.perf_counter() - t0, enter, "combine")
        return combined[: handle.num_tokens].float()
