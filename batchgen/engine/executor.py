"""The coroutine stage executor: moves groups of sequence coroutines through the model's stages
(``embed``, ``attention_stage``, ``ffn_stage``, ``compute_logits``) and, under the ``coalesce``
policy, merges every group waiting at the same MoE layer into one expert computation.

Policies (`EngineConfig.scheduler_policy`):

- ``lockstep``: classic continuous batching. A step is one group of at most
  ``max_num_batched_tokens`` tokens that runs through every layer (the vLLM-style baseline).
- ``coalesce``: a step holds up to ``max_step_tokens`` tokens of up to ``max_num_seqs`` (alias
  ``max_active_coroutines``) coroutines, cut into attention micro-batches (groups) of at most
  ``max_num_batched_tokens`` tokens each (this bounds attention's activation memory). Attention
  runs per group; the FFN stage of a layer runs once for all groups waiting there, prefill
  chunks and decode tokens alike, so each expert GEMM gets the rows of every group.

`ExpertBatchCoalescer` decides when an FFN stage may run: it holds the stage back while some
group is still behind it (and can therefore reach it) and the tokens already waiting would give
the experts fewer than ``expert_coalesce_threshold`` rows on average; otherwise it runs, over
every group waiting there. The executor always advances the most advanced runnable group, and
an attention stage is always runnable, so some group moves on every iteration: no deadlock, and
every group finishes the step (no starvation).

Under expert parallelism (``expert_parallel=True``) every MoE layer's FFN stage runs exactly
once per step, over every group (it waits until no group is behind it), because each run is a
dispatch / combine pair that every rank must issue the same number of times (DESIGN.md); and
`execute_dummy` lets a rank without tokens take part in every layer's pair with zero rows.
With ``local_prefill`` a step's prefill rows are marked ``local_rows`` for the MoE layers (the
``data_parallel_offload`` strategy: their experts run on this rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from batchgen.engine.metrics import EngineMetrics, StageTimer
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.scheduler import ScheduledSeq
from batchgen.engine.sequence import Sublayer
from batchgen.models.layers.attention import AttentionMetadata
from batchgen.models.layers.norm import cat_prenormed, split_prenormed

POLICIES = ("coalesce", "lockstep")


@dataclass(eq=False)
class CoroutineGroup:
    """A micro-batch: coroutines that run their attention stages together.

    Attributes:
        entries: the scheduled coroutines (each with its number of new tokens), flat order.
        input_ids: ``[T]`` int64; meta: the group's attention layout; sample_indices: ``[B]``
            rows of the group's hidden state whose next token is sampled.
        hidden: the residual stream ``[T, H]`` between stages (None before ``embed``).
        layer / sublayer: the cursor, the stage this group runs next.
    """

    entries: list[ScheduledSeq]
    input_ids: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    hidden: torch.Tensor | None = None
    layer: int = 0
    sublayer: Sublayer = Sublayer.ATTN
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = int(self.input_ids.shape[0])

    @property
    def cursor(self) -> tuple[int, Sublayer]:
        return (self.layer, self.sublayer)


class ExpertBatchCoalescer:
    """Decides whether the FFN stage at a cursor may run now (see the module docstring).

    Args:
        threshold: ``expert_coalesce_threshold``, mean rows per expert below which a stage is
            held back while other groups can still reach it.
        num_experts / top_k: of the model's MoE layers (0 for a dense model: never hold).
    """

    def __init__(self, threshold: int, num_experts: int, top_k: int) -> None:
        self.threshold, self.num_experts, self.top_k = threshold, num_experts, top_k
        self.num_holds = 0

    def ready(self, cursor: tuple[int, Sublayer], groups: list[CoroutineGroup]) -> bool:
        if not self.num_experts:
            return True
        behind = any(g.cursor < cursor for g in groups)
        if not behind:
            return True  # nothing else can arrive: flush
        waiting = sum(g.num_tokens for g in groups if g.cursor == cursor)
        if waiting * self.top_k / self.num_experts >= self.threshold:
            return True
        self.num_holds += 1
        return False


class StageExecutor:
    """Runs one engine step stage by stage.

    Args:
        runner: builds group tensors and owns the KV cache.
        policy: "coalesce" or "lockstep".
        max_num_batched_tokens: tokens per attention micro-batch.
        expert_coalesce_threshold: see `ExpertBatchCoalescer`.
        metrics: receives stage times.
        expert_parallel: one FFN stage per MoE layer per step (see the module docstring).
    """

    def __init__(
        self,
        runner: ModelRunner,
        policy: str,
        max_num_batched_tokens: int,
        expert_coalesce_threshold: int,
        metrics: EngineMetrics,
        expert_parallel: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduler_policy must be one of {POLICIES}, got {policy!r}")
        self.runner, self.policy, self.metrics = runner, policy, metrics
        self.model = runner.model
        self.max_group_tokens = max_num_batched_tokens
        cfg = self.model.config
        self.expert_parallel = expert_parallel
        self.coalescer = ExpertBatchCoalescer(
            math.inf if expert_parallel else expert_coalesce_threshold,
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
        )
        self.layer_is_moe = cfg.layer_is_moe
        self.timer = StageTimer(metrics, runner.device)
        # Decode-only steps by graph replay (`batchgen.engine.cuda_graphs`), set by the engine.
        self.graph_runner = None

    def form_groups(self, scheduled: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
        """Pack entries, in order, into groups of at most ``max_num_batched_tokens`` tokens
        (lockstep: one group, the scheduler already bounded the step)."""
        if self.policy == "lockstep":
            return [scheduled]
        groups: list[list[ScheduledSeq]] = []
        current: list[ScheduledSeq] = []
        size = 0
        for entry in scheduled:
            if current and size + entry.num_new_tokens > self.max_group_tokens:
                groups.append(current)
                current, size = [], 0
            current.append(entry)
            size += entry.num_new_tokens
        if current:
            groups.append(current)
        return groups

    def flush_stage_times(self) -> None:
        """Count the stage times recorded on the device (`StageTimer.flush`): the engine
        calls it after sampling."""
        self.timer.flush()

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSeq], local_prefill: bool = False
    ) -> tuple[list[ScheduledSeq], torch.Tensor, list[tuple[ScheduledSeq, torch.Tensor]]]:
        """Run a step. Returns the entries that sample a token (row order), their logits
        ``[B, V]`` float32, and for each entry with ``prompt_logits`` positions the final hidden
        states there (``[len(prompt_logits), H]``; the caller turns them into logits chunk by
        chunk). ``local_prefill``: see the module docstring. A step the ``graph_runner`` takes
        (decode-only, one micro-batch: `CUDAGraphRunner.can_run`) replays a CUDA graph."""
        if self.graph_runner is not None and not local_prefill:
            t0 = self.timer.start()
            out = self.graph_runner.execute(scheduled)
            if out is not None:
                self.timer.stop("cuda_graph", t0)
                self.metrics.cuda_graph_steps += 1
                return out
        groups = []
        for entries in self.form_groups(scheduled):
            input_ids, meta, ordered, sample_indices = self.runner.prepare(entries)
            group = CoroutineGroup(ordered, input_ids, meta, sample_indices)
            for e in ordered:
                e.seq.group = group
            groups.append(group)
        self.run_stages(groups, local_prefill)
        sampling: list[ScheduledSeq] = []
        rows = []
        prompt_rows: list[tuple[ScheduledSeq, torch.Tensor]] = []
        for group in groups:
            sampling.extend(e for e in group.entries if e.samples_next_token)
            rows.append(group.hidden.index_select(0, group.sample_indices))
            offset = 0  # flat index of the entry's first token (entries are in flat order)
            for e in group.entries:
                e.seq.group = None
                if e.prompt_logits:
                    first = offset + e.prompt_logits.start - e.seq.num_computed_tokens
                    prompt_rows.append((e, group.hidden[first : first + len(e.prompt_logits)]))
                offset += e.num_new_tokens
        t0 = self.timer.start()
        logits = self.model.compute_logits(torch.cat(rows))  # [B, V]
        self.timer.stop("lm_head", t0)
        return sampling, logits, prompt_rows

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """A step without tokens: every MoE layer's FFN stage on zero rows, so that this rank
        issues the same collectives as the ranks that have tokens (expert parallelism)."""
        t0 = self.timer.start()
        empty = torch.empty(0, self.model.config.hidden_size, device=self.runner.device)
        empty = empty.to(self.model.embed_tokens.weight.dtype)
        for layer in range(self.model.num_layers):
            if self.layer_is_moe[layer]:
                self.model.ffn_stage(layer, empty)
        self.timer.stop("moe", t0)

    @staticmethod
    def _prefill_rows(peers: list[CoroutineGroup]) -> torch.Tensor:
        """Row indices of the prefill tokens in ``cat(peers' hidden)`` (each group's rows are
        its decode tokens, then its prefill chunks: `ModelRunner.prepare`)."""
        rows, offset = [], 0
        for g in peers:
            rows.append(torch.arange(offset + g.meta.num_decode_tokens, offset + g.num_tokens))
            offset += g.num_tokens
        return torch.cat(rows).to(peers[0].input_ids.device)

    def run_stages(self, groups: list[CoroutineGroup], local_prefill: bool = False) -> None:
        """Advance every group through every layer (see the module docstring for the order)."""
        num_layers = self.model.num_layers
        kv = self.runner.kv_caches
        timer = self.timer
        for g in groups:
            g.hidden = self.model.embed(g.input_ids)
        active = list(groups)
        while active:
            group = self._next(active)
            layer = group.layer
            t0 = timer.start()
            if group.sublayer is Sublayer.ATTN:
                group.hidden = self.model.attention_stage(
                    layer, group.hidden, group.meta, kv[layer]
                )
                group.sublayer = Sublayer.FFN
                timer.stop("attention", t0)
                continue
            peers = [g for g in active if g.cursor == group.cursor]
            rows = None
            if local_prefill and self.layer_is_moe[layer]:
                rows = self._prefill_rows(peers)
            extra = () if rows is None else (rows,)
            if len(peers) == 1:
                group.hidden = self.model.ffn_stage(layer, group.hidden, *extra)
            else:  # coalesced: one FFN call over every waiting group's tokens
                # The normed rows `add_and_prenorm` attached travel through the concatenation
                # and the split, so neither this FFN nor the next attention norms them again.
                merged = cat_prenormed([g.hidden for g in peers])
                merged = self.model.ffn_stage(layer, merged, *extra)
                sizes = [g.num_tokens for g in peers]
                for g, h in zip(peers, split_prenormed(merged, sizes), strict=True):
                    g.hidden = h
            timer.stop("moe" if self.layer_is_moe[layer] else "dense_ffn", t0)
            for g in peers:
                g.layer, g.sublayer = layer + 1, Sublayer.ATTN
            active = [g for g in active if g.layer < num_layers]

    def _next(self, active: list[CoroutineGroup]) -> CoroutineGroup:
        """The most advanced group whose next stage may run."""
        for group in sorted(active, key=lambda g: g.cursor, reverse=True):
            if group.sublayer is Sublayer.ATTN or self.coalescer.ready(group.cursor, active):
                return group
        raise AssertionError("unreachable: an attention stage is always runnable")
