"""A CPU stand-in for the part of ``deep_ep`` that `DeepEPDispatcher` uses, for tests only:
``Buffer(group, num_nvl_bytes, num_rdma_bytes)``, ``Buffer.get_dispatch_config`` /
``get_combine_config`` (``Config`` with the two size hints), ``get_dispatch_layout``, normal-mode
``dispatch`` (non-cached, with top-k) and ``combine`` (no weights, no bias), ``topk_idx_t``.
Injected with ``sys.modules["deep_ep"] = fake_deep_ep``; moves data with
``torch.distributed.all_to_all_single`` (gloo, as bytes).

Semantics follow DeepEP's source (``deep_ep/buffers/legacy.py``, ``csrc/legacy/buffer.hpp``,
``csrc/kernels/legacy/intranode.cu``, ``tests/legacy/test_intranode.py`` at DeepEP dd758ca):

- experts in equal blocks, rank r owning ``[r*L, (r+1)*L)``, ``num_experts % num_ranks == 0``
  and ``L <= 1024`` asserted;
- ``dispatch`` sends a token once to each rank holding one of its experts; received rows are
  grouped by source rank (``rank_prefix_matrix``), in token order within a source;
  ``recv_topk_idx`` holds local indices (``id - r*L``) or -1, ``recv_topk_weights`` holds 0
  where the index is -1; ``num_recv_tokens_per_expert_list`` counts rows per local expert,
  rounded up to ``expert_alignment``;
- ``combine`` takes bf16 rows only (``SWITCH_TYPES``), adds a token's rows from every rank it
  went to in float32 without weights, and rounds to bf16; a token sent nowhere gets zeros.

Where the source does not settle it, the fake picks and says so:

- Row order within a source rank: the intranode kernel splits tokens into contiguous channels,
  which keeps token order; the internode kernels may not. The adapter must not depend on it
  and does not (it only returns rows through DeepEP's handle).
- The order in which combine adds the ranks' rows: the fake adds in rank order; the real
  kernel's order is its own, so only rounding-level agreement may be assumed.
- A ``[0, K]`` ``topk_idx``: HEAD shows no explicit check, but SGLang PR #25397 reports a
  null-pointer assertion for it; the fake refuses it (stricter), and the adapter never sends it.
- ``get_dispatch_config`` for a rank count DeepEP has no config for: the real one asserts. The
  fake accepts any count unless ``STRICT_NUM_RANKS`` is set, so that 3-rank tests can run.

What it cannot check: CUDA streams and events, buffer capacity (the real kernels queue through
a buffer of the hinted size), NVLink/RDMA, FP8, the cached-handle and ``num_worst_tokens``
paths, internode ordering, the low-latency kernels, and speed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

topk_idx_t = torch.int64
STRICT_NUM_RANKS = False
# The rank counts DeepEP's legacy Buffer has tuned configs for (get_dispatch_config).
CONFIG_NUM_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
NUM_MAX_NVL_PEERS = 8
NUM_MAX_LOCAL_EXPERTS = 1024


class Config:
    """DeepEP's ``Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)`` with its size
    hints (``csrc/legacy/config.hpp``: the NVL hint's terms; RDMA 0 within one node)."""

    def __init__(self, num_sms, nvl_send, nvl_recv, rdma_send=6, rdma_recv=128):
        assert nvl_send < nvl_recv and rdma_send <= rdma_recv // 2
        self.num_sms, self.nvl_recv, self.rdma_recv = num_sms, nvl_recv, rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        channels, nvl = self.num_sms // 2, min(num_ranks, NUM_MAX_NVL_PEERS)
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        per_token = hidden_bytes + 128 * (8 + 4) + 128 * 4
        n = channels * nvl * ((2 * rdma_ranks + 3) * 4 + self.nvl_recv * per_token)
        return (n + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        return self.num_sms // 2 * num_ranks // NUM_MAX_NVL_PEERS * self.rdma_recv * hidden_bytes


class EventOverlap:
    """Nothing runs asynchronously on CPU."""

    def current_stream_wait(self) -> None:
        pass


def _config(num_ranks: int, nvl_send: int) -> Config:
    if STRICT_NUM_RANKS:
        assert num_ranks in CONFIG_NUM_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
    return Config(Buffer.num_sms, nvl_send, 256)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.empty(t.shape[0], t.shape[1] * t.element_size(), dtype=torch.uint8)
    return t.contiguous().view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N, C]`` uint8 -> ``[N, C / itemsize]`` of ``dtype`` (a copy)."""
    size = torch.empty(0, dtype=dtype).element_size()
    out = torch.empty(b.shape[0], b.shape[1] // size, dtype=dtype)
    if b.numel():
        out.view(torch.uint8).view(b.shape).copy_(b)
    return out


class Buffer:
    """The normal-mode subset of ``deep_ep.Buffer`` (see the module docstring)."""

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, **kwargs):
        if kwargs.get("low_latency_mode"):
            raise NotImplementedError("fake_deep_ep: low-latency mode is not faked")
        self.group = group
        self.rank, self.group_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        assert num_nvl_bytes > 0, "the adapter sized no NVL buffer"
        # The real constructor all-gathers device ids and IPC handles: a collective.
        ids: list = [None] * self.group_size
        dist.all_gather_object(ids, (self.rank, num_nvl_bytes, num_rdma_bytes), group=group)
        assert len({(n, r) for _, n, r in ids}) == 1, f"ranks sized buffers differently: {ids}"

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return _config(num_ranks, 24 if num_ranks == 2 else 6)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return _config(num_ranks, 10 if num_ranks == 2 else 4)

    def get_dispatch_layout(
        self, topk_idx, num_experts, previous_event=None, async_finish=False,
        allocate_on_comm_stream=False,
    ):
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == topk_idx_t
        assert num_experts > 0 and num_experts % self.group_size == 0
        assert topk_idx.shape[0] > 0, "empty topk_idx (see SGLang PR #25397)"
        per = num_experts // self.group_size
        valid = topk_idx >= 0
        rank_of = torch.where(valid, topk_idx // per, -1)  # [T, K]
        is_token_in_rank = torch.zeros(topk_idx.shape[0], self.group_size, dtype=torch.bool)
        for r in range(self.group_size):
            is_token_in_rank[:, r] = (rank_of == r).any(dim=1)
        per_rank = is_token_in_rank.sum(0).to(torch.int32)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        per_rdma = None
        if self.group_size > NUM_MAX_NVL_PEERS:
            nodes = is_token_in_rank.view(topk_idx.shape[0], -1, NUM_MAX_NVL_PEERS).any(2)
            per_rdma = nodes.sum(0).to(torch.int32)
        return per_rank, per_rdma, per_expert, is_token_in_rank, EventOverlap()

    def _exchange(self, send: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
        recv = send.new_empty(sum(recv_counts), send.shape[1])
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group)
        return recv

    def dispatch(
        self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
        is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
        expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
        async_finish=False, allocate_on_comm_stream=False,
    ):
        if handle is not None or isinstance(x, tuple) or num_worst_tokens:
            raise NotImplementedError("fake_deep_ep: cached, FP8 and worst-token dispatch")
        assert topk_idx is not None and topk_weights is not None, "fake: top-k dispatch only"
        assert x.dim() == 2 and x.is_contiguous() and x.shape[1] * x.element_size() % 16 == 0
        assert topk_weights.dtype == torch.float32 and topk_idx.dtype == topk_idx_t
        assert topk_idx.shape == topk_weights.shape and topk_idx.shape[0] == x.shape[0]
        assert is_token_in_rank.dtype == torch.bool and num_tokens_per_rank.dtype == torch.int32
        w, num_experts = self.group_size, num_tokens_per_expert.shape[0]
        assert num_experts % w == 0 and num_experts // w <= NUM_MAX_LOCAL_EXPERTS
        per = num_experts // w
        k = topk_idx.shape[1]
        token_lists, parts = [], []
        for r in range(w):
            tokens = is_token_in_rank[:, r].nonzero().squeeze(1)  # token order
            idx = topk_idx.index_select(0, tokens)
            local = torch.where((idx >= r * per) & (idx < (r + 1) * per), idx - r * per, -1)
            weights = torch.where(local >= 0, topk_weights.index_select(0, tokens), 0.0)
            rows = x.index_select(0, tokens)
            parts.append(torch.cat([_as_bytes(rows), _as_bytes(local), _as_bytes(weights)], 1))
            token_lists.append(tokens)
        send_counts = [int(t.numel()) for t in token_lists]
        assert send_counts == num_tokens_per_rank.tolist()
        counts = torch.tensor(send_counts, dtype=torch.int64)
        recv_counts_t = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts_t, counts, group=self.group)
        recv_counts = recv_counts_t.tolist()
        recv = self._exchange(torch.cat(parts), send_counts, recv_counts)
        hb = x.shape[1] * x.element_size()
        recv_x = _from_bytes(recv[:, :hb], x.dtype)
        recv_idx = _from_bytes(recv[:, hb : hb + 8 * k], topk_idx_t)
        recv_weights = _from_bytes(recv[:, hb + 8 * k :], torch.float32)
        counts_per_expert = torch.bincount(recv_idx[recv_idx >= 0], minlength=per).tolist()
        a = expert_alignment
        aligned = [(c + a - 1) // a * a for c in counts_per_expert]
        fake_handle = (token_lists, send_counts, recv_counts, x.shape[0])
        return recv_x, recv_idx, recv_weights, aligned, fake_handle, EventOverlap()

    def combine(
        self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
        async_finish=False, allocate_on_comm_stream=False,
    ):
        if topk_weights is not None or bias is not None:
            raise NotImplementedError("fake_deep_ep: combine with weights or bias")
        assert x.dtype == torch.bfloat16, f"DeepEP's combine takes bfloat16, got {x.dtype}"
        token_lists, send_counts, recv_counts, num_tokens = handle
        assert x.dim() == 2 and x.shape[0] == sum(recv_counts)
        back = _from_bytes(self._exchange(_as_bytes(x), recv_counts, send_counts), torch.bfloat16)
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32)
        start = 0
        for tokens in token_lists:  # rank order
            n = tokens.numel()
            out.index_add_(0, tokens, back[start : start + n].float())
            start += n
        return out.to(torch.bfloat16), None, EventOverlap()
