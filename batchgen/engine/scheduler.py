"""Continuous batching with chunked prefill and preemption by recompute (pure Python).

Follows vLLM v1's scheduler: no separate prefill and decode phases; every running sequence
gets ``min(num_tokens - num_computed_tokens, budget)`` new tokens per step, which covers
decodes (1 token), whole prompts and prompt chunks alike, under the per-step token budget
``max_num_batched_tokens``. Running sequences are served first, oldest first; when the KV cache
is full the most recently admitted running sequence is preempted (its blocks freed, its
``num_computed_tokens`` reset: it will be recomputed, prompt plus outputs so far) and put back
at the head of the waiting queue. Waiting sequences are admitted only when no preemption
happened in the step, while the budget, ``max_num_seqs`` and free blocks allow.

Liveness: the engine caps ``max_model_len`` at the KV capacity, so a running sequence alone can
always allocate; every step schedules at least one token while any sequence is unfinished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.block_manager import KVCacheManager
from batchgen.engine.sequence import SequenceCoroutine, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: SequenceCoroutine
    num_new_tokens: int

    @property
    def samples_next_token(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SequenceCoroutine] = field(default_factory=list)

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
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_chunk_tokens: int | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # One sequence's tokens per step (a prefill chunk); the coalesce policy sets it to the
        # attention micro-batch size while the step budget spans several micro-batches.
        self.max_chunk_tokens = max_chunk_tokens or max_num_batched_tokens
        self.waiting: deque[SequenceCoroutine] = deque()
        self.running: list[SequenceCoroutine] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: SequenceCoroutine) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, self.max_chunk_tokens)
            if self._allocate_or_preempt(seq, num_new, out):
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
            else:
                break  # `seq` preempted itself: nothing younger is left running
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, self.max_chunk_tokens)
            if not self.kv_cache.allocate_slots(seq, num_new):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

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
        """Mark ``seq`` finished and free its blocks (it may be running or waiting)."""
        seq.status = SequenceStatus.FINISHED
        self.kv_cache.free(seq)

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
