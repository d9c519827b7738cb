"""Per-request and per-sample state: plain data, derived values as properties.

A `Request` is what the user submitted (one prompt, one `SamplingParams`); it owns ``n``
`SequenceCoroutine` objects, one per sample (DESIGN.md's sequence coroutines: token history,
block table, position, phase, sampling state and a cursor ``(layer, sublayer)`` while the
executor moves it through a step's stages). The scheduler works on sequences. Following vLLM
v1 there is no separate prefill/decode bookkeeping: each sequence has ``num_computed_tokens``
catching up with ``num_tokens``; a sequence is in prefill while the gap exceeds one token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchgen.outputs import RequestMetrics

if TYPE_CHECKING:
    import torch

    from batchgen.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted (its KV blocks were freed)
    RUNNING = "running"
    FINISHED = "finished"


class Phase(enum.Enum):
    """DESIGN.md's coroutine phases, derived from status and progress."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Sublayer(enum.IntEnum):
    """Where inside a decoder layer a coroutine stands: before attention or before the FFN."""

    ATTN = 0
    FFN = 1


@dataclass(eq=False)
class SequenceCoroutine:
    """One sample being generated.

    Attributes:
        seq_id: engine-unique integer id.
        request: the owning request.
        index: sample index in ``[0, n)``.
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens whose K/V are in the cache (reset to 0 on preemption: the
            sequence is recomputed, prompt and outputs alike).
        block_table: KV cache block ids, in position order.
        generator: per-sample RNG when the request is seeded.
        detokenizer: incremental detokenizer (`batchgen.engine.detokenizer`).
        logprobs: per generated token ``{token_id: Logprob}`` when requested.
        cumulative_logprob: sum of sampled-token logprobs.
        finish_reason / stop_reason: as in `CompletionOutput`.
        num_preemptions: how often this sequence was preempted (metric).
        kv_import: K/V of its first positions shipped from another engine (straggler
            rebalancing), written into its blocks when the scheduler admits it.
        block_hashes: memoized content hashes of its full blocks of tokens, in order
            (`batchgen.engine.prefix_cache.block_hashes`; tokens are only appended).
        grammar: the sample's structured-output state (`batchgen.structured.matcher
            .SequenceGrammar`) when its request is constrained, else None.
    """

    seq_id: int
    request: Request
    index: int
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    detokenizer: Any = None
    logprobs: list[dict] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    kv_import: Any = None  # `migration.KVPayload` shipped from another engine, until admitted
    grammar: Any = None
    block_hashes: list[bytes] = field(default_factory=list)
    group: Any = None  # the executor's `CoroutineGroup` while the coroutine is inside a step

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        # read per row several times a step: the lengths directly, not through the properties
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def token_id_at(self, position: int) -> int:
        n = self.num_prompt_tokens
        return (
            self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]
        )

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)`` of prompt + output."""
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def phase(self) -> Phase:
        if self.status is SequenceStatus.FINISHED:
            return Phase.FINISHED
        if self.status is SequenceStatus.WAITING:
            return Phase.PREEMPTED if self.num_preemptions else Phase.WAITING
        # Prefill while more than the newest token is missing from the cache.
        return Phase.PREFILL if self.num_tokens - self.num_computed_tokens > 1 else Phase.DECODE

    @property
    def cursor(self) -> tuple[int, Sublayer] | None:
        """``(layer, sublayer)`` the coroutine will run next while inside a step, else None.
        The executor moves whole groups, so the cursor lives on the coroutine's group."""
        return None if self.group is None else self.group.cursor


@dataclass(eq=False)
class Request:
    """A user request: one prompt, one `SamplingParams`, ``params.n`` sequences, and its
    timestamps (`RequestMetrics`, filled in by the engine).

    ``prompt_logprobs``: when the request asked for them, the entries known so far, in prompt
    order (``[None]`` for the first token at the start; complete at ``num_prompt_tokens``
    entries); filled by whichever sample computes the positions (`batchgen.engine.prompt_logprobs`).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    seqs: list[SequenceCoroutine] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    prompt_logprobs: list[dict | None] | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def needs_prompt_logits(self) -> bool:
        """True while some prompt log-probabilities are missing: then no sample of this request
        may take prompt positions it did not compute (shared or cached K/V carry no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )
