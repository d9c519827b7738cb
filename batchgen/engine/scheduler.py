"""Continuous batching with chunked prefill and preemption by recompute (pure Python).

Follows vLLM v1's scheduler: no separate prefill and decode phases; every running sequence
gets ``min(num_tokens - num_computed_tokens, budget)`` new tokens per step, which covers
decodes (1 token), whole prompts and prompt chunks alike, under the per-step token budget
``max_num_batched_tokens``. Running sequences are served first, oldest first; when the KV cache
is full the most recently admitted running sequence is preempted (its blocks freed, its
``num_computed_tokens`` reset: it will be recomputed, prompt plus outputs so far) and put back
at the head of the waiting queue. Waiting sequences are admitted only when no preemption
happened in the step, while the budget, ``max_num_seqs`` and free blocks allow.

Parallel sampling (``n`` > 1) with ``enable_prefix_sharing``: the samples of a request have
the same prompt, so only the first one admitted prefills it. Its siblings stay waiting while it
is in prefill (later waiting sequences are admitted past them), then each is admitted with the
K/V of the first ``prompt_len - 1`` positions shared from a running sibling
(`KVCacheManager.share_prefix`) and computes only the last prompt token itself, which yields
its own first-token logits. vLLM gets the same effect from prefix caching. A request that asked
for ``prompt_logprobs`` shares nothing while some are unknown (`Request.needs_prompt_logits`):
shared positions were computed elsewhere and have no logits here. In practice its first sample
computes them all, its siblings wait as usual and then share; the rule is what any cache of
prompt K/V must follow (cost: such a request always prefills its whole prompt once).

Prefix caching across requests (``enable_prefix_caching``, `batchgen.engine.prefix_cache`): a
sequence admitted with nothing computed (a new one, or one preempted: it may find its own freed
blocks) takes the longest run of cached full blocks of its tokens, always leaving its last
token to compute, and its prefill starts after them (chunked like any other). A sequence whose
next full blocks a running prefill is computing right now waits for them when they are at least
half of what it would compute (`_worth_waiting`): later waiting sequences are admitted past it,
as past deferred siblings, and it finds those blocks cached a step or a few later, instead of
every request over one document computing it in the same step. (Blocks are registered only
after the step that computes them, so nothing can hit a block of the step it is written in.)
This wait is the only reordering for the cache: admission otherwise stays first come, first
served. A request asking for ``prompt_logprobs`` neither looks up the cache nor waits (a cached
block has no logits), and samples given a prefix by a sibling (above) or K/V shipped from
another engine (below) do not look it up either.

A sequence moved from another engine with its K/V (``seq.kv_import``, straggler rebalancing)
is admitted like any waiting one, with those positions counted as computed: it allocates their
blocks and the engine writes the K/V into them before the step (``SchedulerOutput.kv_imports``).

In the batch-invariant mode (``aligned_chunks``) a prompt is cut only at multiples of the chunk
size and a chunk is scheduled whole or waits for the next step, so where a prompt is cut never
depends on what else is running (`Scheduler.chunk_tokens`).

Liveness: the engine caps ``max_model_len`` at the KV capacity, so a running sequence alone can
always allocate; every step schedules at least one token while any sequence is unfinished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.block_manager import KVCacheManager
from batchgen.engine.prefix_cache import block_hashes
from batchgen.engine.sequence import SequenceCoroutine, SequenceStatus

_DEFER = object()  # `Scheduler._prefix_source`: wait for a sibling's prefill


def _worth_waiting(missing: list[bytes], pending: set[bytes]) -> bool:
    """A sequence whose first uncached blocks (``missing``) a running prefill is computing
    (``pending``) waits for them when they are at least half of the full blocks it would
    compute: it then finds them cached instead of computing them a second time."""
    shared = 0
    for block_hash in missing:
        if block_hash not in pending:
            break
        shared += 1
    return shared > 0 and 2 * shared >= len(missing)


@dataclass
class ScheduledSeq:
    """``num_new_tokens`` of ``seq`` to compute in this step, from ``seq.num_computed_tokens``.
    ``prompt_logits``: the positions among them whose hidden states the step keeps for the
    request's prompt log-probabilities (set by the engine, `batchgen.engine.prompt_logprobs`)."""

    seq: SequenceCoroutine
    num_new_tokens: int
    prompt_logits: range = range(0)

    @property
    def samples_next_token(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SequenceCoroutine] = field(default_factory=list)
    # (src_block, dst_block) KV copies to make before the step runs (shared prompt prefixes).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_shared_prefix_tokens: int = 0
    # Sequences admitted with K/V shipped from another engine (``seq.kv_import``): the engine
    # writes it into their new blocks before the step runs.
    kv_imports: list[SequenceCoroutine] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Admission, chunking and preemption decisions for one engine step.

    Args:
        kv_cache: block bookkeeping.
        max_num_seqs: max sequences in RUNNING state.
        max_num_batched_tokens: max new tokens scheduled per step.
        max_chunk_tokens: max new tokens of one sequence per step (default: the step budget).
        enable_prefix_sharing: samples of one request share their prompt's KV blocks.
        aligned_chunks: cut every sequence's prefill at the multiples of ``max_chunk_tokens``
            only, and schedule a chunk only whole (`chunk_tokens`), so where a prompt is cut
            never depends on its batch mates (the batch-invariant mode).
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_chunk_tokens: int | None = None,
        enable_prefix_sharing: bool = False,
        aligned_chunks: bool = False,
    ) -> None:
        self.kv_cache = kv_cache
        self.aligned_chunks = aligned_chunks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # One sequence's tokens per step (a prefill chunk); the coalesce policy sets it to the
        # attention micro-batch size while the step budget spans several micro-batches.
        self.max_chunk_tokens = max_chunk_tokens or max_num_batched_tokens
        if aligned_chunks:  # a whole chunk must fit an empty step, or nothing would run
            self.max_chunk_tokens = min(self.max_chunk_tokens, max_num_batched_tokens)
        self.waiting: deque[SequenceCoroutine] = deque()
        self.running: list[SequenceCoroutine] = []
        self.num_preemptions = 0
        self.enable_prefix_sharing = enable_prefix_sharing
        self._handed_over_tokens = 0  # prompt positions given by `finish`, for the next output

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: SequenceCoroutine) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(num_shared_prefix_tokens=self._handed_over_tokens)
        self._handed_over_tokens = 0
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self.chunk_tokens(seq, budget)
            if num_new == 0 and self.aligned_chunks:  # its whole next chunk does not fit
                i += 1
                continue
            if self._allocate_or_preempt(seq, num_new, out):
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
            else:
                break  # `seq` preempted itself: nothing younger is left running
        if out.preempted:
            return out
        deferred: list[SequenceCoroutine] = []  # siblings waiting for a prompt prefill
        # Samples given a shared prefix in this step: their copied block is filled only when
        # the step's copies run, so they must not be the source of another copy now.
        forked: set[int] = set()
        pending: set[bytes] | None = None  # `_pending_blocks`, once a sequence looks them up
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            copies: list[tuple[int, int]] = []
            hit: list[int] | None = None  # cached blocks taken, when the cache was looked up
            if seq.kv_import is not None:  # shipped K/V: its positions count as computed
                seq.num_computed_tokens = seq.kv_import.num_tokens
            elif seq.num_computed_tokens == 0:
                source = None
                if self.enable_prefix_sharing:
                    source = self._prefix_source(seq, forked)
                    if source is _DEFER:
                        deferred.append(seq)
                        continue
                if source is not None:
                    copies = self.kv_cache.share_prefix(seq, source, seq.num_prompt_tokens - 1)
                    if copies is None:  # no block for the copy
                        self.waiting.appendleft(seq)
                        break
                elif self._uses_cache(seq):
                    hit, missing = self.kv_cache.find_cached_prefix(seq)
                    if pending is None:
                        pending = self._pending_blocks()
                    if _worth_waiting(missing, pending):
                        deferred.append(seq)
                        continue
                    self.kv_cache.take_cached_prefix(seq, hit)
            num_new = self.chunk_tokens(seq, budget)
            unfit = num_new == 0 and self.aligned_chunks  # its whole first chunk does not fit
            if unfit or not self.kv_cache.allocate_slots(seq, num_new):
                self.kv_cache.free(seq)  # undo a shared prefix, if any
                seq.num_computed_tokens = 0
                self.waiting.appendleft(seq)
                break
            if hit is not None:
                stats = self.kv_cache.prefix_cache.stats
                stats.queries += seq.num_tokens
                stats.hits += seq.num_computed_tokens
                pending.update(missing)  # it computes them now: later ones wait for them
            elif seq.kv_import is not None:
                out.kv_imports.append(seq)
                forked.add(seq.seq_id)  # its blocks are written only when the step runs
            elif seq.num_computed_tokens:
                out.block_copies.extend(copies)
                out.num_shared_prefix_tokens += seq.num_computed_tokens
                forked.add(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return out

    def _uses_cache(self, seq: SequenceCoroutine) -> bool:
        """Whether ``seq`` looks up the prefix cache when admitted: caching is on and it does
        not ask for prompt logprobs (a cached block has no logits to give them)."""
        return (
            self.kv_cache.prefix_cache is not None
            and getattr(seq.params, "prompt_logprobs", None) is None
        )

    def _pending_blocks(self) -> set[bytes]:
        """Hashes of the full blocks that running prefills have still to compute (they become
        cached when computed): a waiting sequence with the same next blocks may wait for
        them (`_worth_waiting`)."""
        bs = self.kv_cache.block_size
        pending: set[bytes] = set()
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens > 1:
                hashes = block_hashes(seq, (seq.num_tokens - 1) // bs, bs)
                pending.update(hashes[seq.num_computed_tokens // bs :])
        return pending

    def chunk_tokens(self, seq: SequenceCoroutine, budget: int) -> int:
        """New tokens of ``seq`` to schedule with ``budget`` tokens left in the step.

        Default: ``min(left, budget, max_chunk_tokens)``. With ``aligned_chunks`` a chunk ends
        only at the next multiple of ``max_chunk_tokens`` or at the sequence's end, and is
        scheduled whole or not at all (0): with ``max_chunk_tokens = 4`` a 10-token prompt is
        always computed as 4 + 4 + 2, whatever else shares its steps. A decode (1 token) always
        fits a non-empty budget.
        """
        left = seq.num_tokens - seq.num_computed_tokens
        if not self.aligned_chunks:
            return min(left, budget, self.max_chunk_tokens)
        to_boundary = self.max_chunk_tokens - seq.num_computed_tokens % self.max_chunk_tokens
        chunk = min(left, to_boundary)
        return chunk if chunk <= budget else 0

    def _prefix_source(
        self, seq: SequenceCoroutine, forked: set[int]
    ) -> SequenceCoroutine | object | None:
        """For a sample of an ``n`` > 1 request: a running sibling whose cache holds the first
        ``prompt_len - 1`` positions (share from it; not one of the ``forked`` seq ids, whose
        copied block is not filled yet: their own source is running and is found instead),
        `_DEFER` while a sibling is still prefilling the prompt (wait for it), or None (prefill
        the prompt itself)."""
        need = seq.num_prompt_tokens - 1
        if seq.request.params.n == 1 or need < 1:
            return None
        prefilling = False
        for sibling in seq.request.seqs:
            if (
                sibling is seq
                or sibling.status is not SequenceStatus.RUNNING
                or sibling.seq_id in forked
            ):
                continue
            if sibling.num_computed_tokens >= need:
                return None if seq.request.needs_prompt_logits else sibling
            prefilling = True
        return _DEFER if prefilling else None

    def _allocate_or_preempt(
        self, seq: SequenceCoroutine, num_new: int, out: SchedulerOutput
    ) -> bool:
        """Allocate for ``seq``, preempting the youngest running sequences as needed.
        Returns False if ``seq`` itself had to be preempted."""
        while not self.kv_cache.allocate_slots(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: SequenceCoroutine) -> None:
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: SequenceCoroutine) -> None:
        """Mark ``seq`` finished and free its blocks (it may be running or waiting).

        With prefix sharing, a running sample that finishes while a sibling still waits hands
        that sibling its prompt blocks, and the sibling starts running with the last prompt
        token to compute. Without this, a sample that finishes in the step that completes its
        prefill (``max_tokens=1``, a stop token first) would free the prompt's K/V while its
        siblings wait for it, and they would prefill the prompt again one after another.
        """
        heir = self._heir(seq)
        seq.status = SequenceStatus.FINISHED
        if heir is not None and self.kv_cache.hand_over(seq, heir, seq.num_prompt_tokens - 1):
            self.waiting.remove(heir)
            heir.status = SequenceStatus.RUNNING
            self.running.append(heir)  # takes the place of `seq` (`remove_finished`)
            self._handed_over_tokens += heir.num_computed_tokens
        self.kv_cache.free(seq)

    def _heir(self, seq: SequenceCoroutine) -> SequenceCoroutine | None:
        """A waiting sibling of running ``seq`` that can take over its prompt blocks."""
        if (
            not self.enable_prefix_sharing
            or seq.status is not SequenceStatus.RUNNING
            or seq.request.params.n == 1
            or seq.num_prompt_tokens < 2
            or seq.request.needs_prompt_logits
        ):
            return None
        for sibling in seq.request.seqs:
            if (
                sibling.status is SequenceStatus.WAITING
                and not sibling.block_table
                and sibling.kv_import is None  # it brings its own K/V
            ):
                return sibling
        return None

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
