"""Sparse Mixture-of-Experts feed-forward, as named steps:

route (``router_logits``) -> select (``topk_weights``, ``topk_ids``) -> sort token activations
by expert -> one GEMM chain per non-empty expert (gate_up, activation, down) -> weighted combine
(+ shared experts).

Shape legend: T = num_tokens, H = hidden_size, E = num_experts, A = num_experts_per_tok (top-k),
I = moe_intermediate_size.

Expert weights use vLLM's `FusedMoE` layout: ``w13_weight [E, 2I, H]`` (gate rows, then up
rows) and ``w2_weight [E, H, I]``.

Beside this module: `moe_sort` (sorting by expert, the slot-order sum every path shares),
`moe_cpu` (the CPU torch path), `batchgen.kernels.grouped_moe` (grouped GEMMs, the CUDA path),
`batchgen.kernels.triton_moe` (Triton fused-MoE, the other CUDA path) and `expert_path`
(which of them runs, chosen in one place).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.fused_moe import fused_moe_available, fused_moe_silu, pack_expert_weights
from batchgen.kernels.grouped_moe import fused_experts_grouped_mm
from batchgen.kernels.invariant_linear import invariant_linear
from batchgen.kernels.moe_routing import topk_softmax, topk_softmax_available
from batchgen.kernels.triton_moe import fused_experts_triton
from batchgen.models.batch_invariant import invariant_activation
from batchgen.models.layers.expert_path import ExpertPath, expert_path
from batchgen.models.layers.mlp import GatedMLP, get_activation
from batchgen.models.layers.moe_cpu import (  # noqa: F401 (re-exported: the CPU torch path)
    CORE_PARALLEL_MAX_MEAN_ROWS,
    cpu_expert_workers,
    fused_experts_per_expert,
)
from batchgen.models.layers.moe_sort import route_rows, sort_by_expert, sum_slots  # noqa: F401
from batchgen.models.model_config import RouterConfig


def select_experts_softmax(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing (Mixtral, Qwen-MoE, OLMoE): probabilities over all experts in float32,
    keep the top-k, optionally renormalise them to sum to 1 (HF `MixtralTopKRouter`,
    `Qwen2MoeTopKRouter`).

    Args:
        router_logits: ``[T, E]``.
    Returns:
        ``topk_weights [T, A]`` float32 and ``topk_ids [T, A]`` int64.
    On CPU torch's softmax and one kernel call (`batchgen.kernels.moe_routing.topk_softmax`:
    the same result bit for bit, ties included), else the torch ops below.
    """
    if topk_softmax_available(router_logits):
        return topk_softmax(router_logits, top_k, norm_topk_prob)
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, A]
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    router: RouterConfig,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to the routing rule of ``router`` (see `RouterConfig`). Returns
    ``topk_weights [T, A]`` float32 (routed scaling applied) and ``topk_ids [T, A]`` int64."""
    if router.topk_method == "greedy" and router.scoring_func == "softmax":
        if topk_softmax_available(router_logits):  # the scaling in the same call
            scale = router.routed_scaling_factor
            return topk_softmax(router_logits, top_k, router.norm_topk_prob, scale)
        weights, ids = select_experts_softmax(router_logits, top_k, router.norm_topk_prob)
        if router.routed_scaling_factor != 1.0:
            weights = weights * router.routed_scaling_factor
        return weights, ids
    from batchgen.models.layers.deepseek_moe import select_experts_deepseek

    return select_experts_deepseek(
        router_logits,
        top_k,
        scoring_func=router.scoring_func,
        topk_method=router.topk_method,
        n_group=router.n_group,
        topk_group=router.topk_group,
        norm_topk_prob=router.norm_topk_prob,
        routed_scaling_factor=router.routed_scaling_factor,
        e_score_correction_bias=e_score_correction_bias,
    )


def fused_experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act=F.silu,
    stats=None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain torch expert computation: one GEMM chain per non-empty expert over its sorted rows.

    Args:
        x: ``[T, H]``; w13: ``[E, 2I, H]``; w2: ``[E, H, I]``; topk_weights: ``[T, A]`` (float32);
        topk_ids: ``[T, A]`` int64; stats: optional recorder with ``record(counts)`` (the
        engine's `ExpertGemmStats`); out_dtype: the result's dtype (default x's).
    Returns:
        ``[T, H]``: ``sum_a topk_weights[t, a] * expert_{topk_ids[t, a]}(x[t])``.
        The weighting and the sum over the top-k run in float32 (`sum_slots`: slot order, as
        the fused CPU kernel), cast once at the end (HF `MixtralExperts` also weights in
        float32). Un-sorting is a gather with the inverse permutation, which is much faster
        on CPU than `index_add_`.
    """
    num_tokens, top_k = topk_ids.shape
    order, counts, token_idx = route_rows(topk_ids, w13.shape[0], stats)
    x_sorted = x.index_select(0, token_idx)  # [T*A, H]
    y_sorted = torch.empty_like(x_sorted, dtype=torch.float32)  # [T*A, H]
    start = 0
    for expert, m in enumerate(counts):
        if m == 0:
            continue
        gate, up = F.linear(x_sorted[start : start + m], w13[expert]).chunk(2, dim=-1)  # [m, I]
        y_sorted[start : start + m] = F.linear(act(gate) * up, w2[expert])  # [m, H]
        start += m
    y_sorted.mul_(topk_weights.reshape(-1).index_select(0, order)[:, None])
    # Un-sort (a permutation, so a gather with the inverse order), then sum over the top-k.
    y = y_sorted.index_select(0, torch.argsort(order))  # [T*A, H] in (token, slot) order
    return sum_slots(y.view(num_tokens, top_k, x.shape[1])).to(out_dtype or x.dtype)  # [T, H]


def _version(t: torch.Tensor) -> int | None:
    """``t._version``, or None for an inference-mode tensor (which keeps no version counter)."""
    try:
        return t._version
    except RuntimeError:
        return None


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ optional shared expert), for every MoE family.

    Parameters: ``gate.weight [E, H]`` (the router; DeepSeek-V3 adds
    ``gate.e_score_correction_bias [E]``, and keeps both in float32 in any model dtype), ``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]``;
    with ``shared_intermediate_size`` > 0 a `GatedMLP` ``shared_experts`` (Qwen2-MoE's
    ``shared_expert``, DeepSeek's ``shared_experts``) and, with ``shared_gate``, a
    ``shared_expert_gate [1, H]`` whose sigmoid scales it (Qwen2-MoE). Input/output ``[T, H]``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        router: RouterConfig,
        hidden_act: str = "silu",
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
        correction_bias: bool = False,
        expert_ids: list[int] | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}"
            )
        self.num_experts, self.top_k, self.router = num_experts, top_k, router
        # The routed experts held here (logical ids, in slot order): all of them, or this
        # rank's shard under expert parallelism (`batchgen.distributed`).
        self.expert_ids = list(range(num_experts)) if expert_ids is None else list(expert_ids)
        held = len(self.expert_ids)
        # DeepSeek-V3's sigmoid router keeps ``gate.weight`` and ``e_score_correction_bias``
        # in float32 whatever the model dtype, as HF does (``_keep_in_fp32_modules_strict`` of
        # `DeepseekV3PreTrainedModel`): rounded to bf16 they move the biased scores by up to
        # ~1e-3 and flip near-tied expert choices that HF in bf16 does not flip.
        router_dtype = torch.float32 if router.scoring_func == "sigmoid" else None
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=router_dtype)
        if correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=router_dtype)
            )
        self.w13_weight = nn.Parameter(torch.empty(held, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(held, hidden_size, intermediate_size))
        self.act = get_activation(hidden_act)
        self.stats = None  # the engine injects its `ExpertGemmStats` here
        # Inside a CUDA graph (`batchgen.engine.cuda_graphs`): receives ``topk_ids [T, A]``
        # instead of ``stats`` (whose Python list would sync with the host).
        self.topk_sink = None
        # Batch-invariant mode (`batchgen.models.batch_invariant`): GEMMs whose rows do not
        # depend on each other where the fused kernel does not serve this block.
        self.batch_invariant = False
        # Under expert parallelism: a callable ``(block, x, local_rows) -> [T, H]`` that routes,
        # dispatches, runs the held experts and combines (`ExpertParallelMoE`).
        self.expert_parallel = None
        self._packed = None  # (key, w13 packed, w2 packed) for the CPU kernel, built on first use
        # (device, dtype, batch_invariant, path) chosen once by `pin_expert_path` (the engine)
        self._pinned_path = None
        self.shared_experts = (
            GatedMLP(hidden_size, shared_intermediate_size, hidden_act)
            if shared_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False)
            if shared_intermediate_size and shared_gate
            else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``topk_weights [T, A]`` float32, ``topk_ids [T, A]``."""
        if self.router.scoring_func == "sigmoid":  # DeepSeek-V3 scores in float32
            linear = invariant_linear if self.batch_invariant else F.linear
            router_logits = linear(x.float(), self.gate.weight.float())  # [T, E]
        else:
            router_logits = self.gate(x)  # [T, E]
        bias = getattr(self.gate, "e_score_correction_bias", None)
        return select_experts(router_logits, self.top_k, self.router, bias)

    def invalidate_packed_weights(self) -> None:
        """Drop the CPU kernel's packed expert weights; the next CPU forward packs again.
        Needed after writes the version counter does not see: through ``param.data`` or on
        inference-mode tensors (`batchgen.models.loader.load_weights` calls it)."""
        self._packed = None

    def packed_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`pack_expert_weights` of ``w13_weight`` and ``w2_weight`` for the CPU kernel: built
        on first use and again when either weight is replaced or changed in place through
        autograd-visible ops (keyed on storage and version counter); other writes need
        `invalidate_packed_weights`. Costs a second copy of the expert weights in memory."""
        w13, w2 = self.w13_weight, self.w2_weight
        key = (w13.data_ptr(), _version(w13), w2.data_ptr(), _version(w2))
        if self._packed is None or self._packed[0] != key:
            with torch.no_grad():
                self._packed = (key, pack_expert_weights(w13), pack_expert_weights(w2))
        return self._packed[1], self._packed[2]

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """True when the fused CPU kernel runs this block's experts for activations like ``x``
        (never under autograd: the kernel has no backward)."""
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or self.w13_weight.requires_grad or self.w2_weight.requires_grad
        )
        return not needs_grad and fused_moe_available(x, self.w13_weight, self.w2_weight, self.act)

    def _path(self, x: torch.Tensor) -> ExpertPath:
        pin = self._pinned_path
        if (
            pin is not None
            and x.dtype is pin[1]
            and self.batch_invariant == pin[2]
            and not torch.is_grad_enabled()
            and x.device == pin[0]
        ):
            return pin[3]
        w13, w2 = self.w13_weight, self.w2_weight
        return expert_path(
            x.device,
            x.dtype,
            batch_invariant=self.batch_invariant,
            cpu_kernel=self.uses_kernel(x),
            hidden_size=w13.shape[2],
            intermediate_size=w2.shape[2],
            num_experts=w13.shape[0],
        )

    def expert_path_for(self, device: torch.device, dtype: torch.dtype) -> ExpertPath:
        """The path `experts` takes for activations of ``dtype`` on ``device`` (the engine's),
        as inference (no autograd) runs it. The engine asks once at start, so that a bad or
        impossible ``BATCHGEN_MOE_PATH`` fails there rather than in every request of the
        first step.

        Raises:
            ValueError: as `batchgen.models.layers.expert_path.expert_path`."""
        with torch.no_grad():
            x = torch.empty((0, self.w13_weight.shape[2]), dtype=dtype, device=device)
            return self._path(x)

    def pin_expert_path(self, device: torch.device, dtype: torch.dtype) -> ExpertPath:
        """Choose the path once (`expert_path_for`) and keep it for every later call on
        activations of ``dtype`` on ``device`` without autograd and in the same
        batch-invariant mode, instead of reading the switches and kernel checks per layer per
        call. The engine pins at start, as it chooses the decode attention backend once
        (`ModelRunner.decode_backend`): switches changed after that do not reach this block
        until it is pinned again or `unpin_expert_path` is called; other calls decide per call.

        Raises:
            ValueError: as `expert_path_for` (nothing is pinned then)."""
        self._pinned_path = None
        path = self.expert_path_for(device, dtype)
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as x.device reads
        self._pinned_path = (device, dtype, self.batch_invariant, path)
        return path

    def unpin_expert_path(self) -> None:
        """Decide the path per call again (`pin_expert_path` undone)."""
        self._pinned_path = None

    def experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The held routed experts: ``x [T, H]``, ``topk_weights [T, A]`` float32 and
        ``topk_ids [T, A]`` *slots* of this block (equal to the logical ids unless the experts
        are sharded) -> ``[T, H]`` of ``out_dtype`` (default x's dtype):
        ``sum_a topk_weights[t, a] * expert(x[t])``, the sum over A in float32 in slot order,
        rounded once at the end. The path (fused CPU kernel, CPU torch path, grouped GEMMs,
        Triton fused-MoE or the reference loop) is chosen by `batchgen.models.layers.expert_path.expert_path`,
        and nowhere else."""
        w13, w2 = self.w13_weight, self.w2_weight
        path = self._path(x)
        if path == "cpu_kernel":
            order, counts = sort_by_expert(topk_ids, w13.shape[0])
            if self.stats is not None:
                self.stats.record(counts)
            w13_packed, w2_packed = self.packed_expert_weights()
            # [T, H], summed over the slots in float32; a bf16 result is rounded in the
            # kernel's slot sum (the bits of .to(bfloat16), without the cast's pass).
            dtype = out_dtype or x.dtype
            kernel_dtype = dtype if dtype == x.dtype == torch.bfloat16 else torch.float32
            out = fused_moe_silu(
                x, w13_packed, w2_packed, topk_weights, order, counts, out_dtype=kernel_dtype
            )
            return out.to(dtype)  # no-op unless out_dtype asks for another dtype
        args = (x, w13, w2, topk_weights, topk_ids, self.act, self.stats)
        if path == "grouped_mm":
            return fused_experts_grouped_mm(*args, out_dtype=out_dtype)
        if path == "triton":
            return fused_experts_triton(*args, out_dtype=out_dtype)
        if path == "reference":
            return fused_experts_reference(*args, out_dtype=out_dtype)
        if self.batch_invariant:  # one worker: the fallback GEMM's rounding follows threads
            args = (*args[:5], invariant_activation(self.act), self.stats)
            return fused_experts_per_expert(*args, out_dtype=out_dtype, linear=invariant_linear)
        workers = cpu_expert_workers(x.shape[0], self.top_k, w13.shape[0])
        return fused_experts_per_expert(*args, num_workers=workers, out_dtype=out_dtype)

    def forward(self, x: torch.Tensor, local_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``. ``local_rows`` (expert parallelism only): rows whose
        experts all run on this rank, the ones it does not hold streamed in (the
        ``data_parallel_offload`` prefill)."""
        if self.expert_parallel is not None:
            out = self.expert_parallel(self, x, local_rows)
        else:
            topk_weights, topk_ids = self.route(x)
            if self.topk_sink is not None:
                self.topk_sink(topk_ids)
            out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
