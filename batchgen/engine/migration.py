"""A request leaving one engine and continuing in another (straggler rebalancing).

`export_request` captures, as plain picklable data, what a request's samples have produced so
far; `LLMEngine.release_request` takes the request out of its engine with it, and
`LLMEngine.add_processed_request(..., resume=state)` continues it elsewhere. The receiving engine
recomputes each unfinished sample's prompt and generated tokens as a prefill (the preemption
path: ``num_computed_tokens`` starts at 0), then samples the next token, so nothing of the KV
cache travels. What does travel makes the final `RequestOutput` the one an unmoved run gives:

- the generated token ids (the sampler's penalties see them, the prefill recomputes them);
- the seeded generator's state (``torch.Generator.get_state``): the next draw continues the
  sample's stream, so seeded sampling does not depend on the rank (a request's generator is
  its own, `batchgen.engine.sampler.make_generator`);
- logprobs and the cumulative logprob so far, the detokenizer's state (emitted text, offsets,
  stop-string tail), and finished samples of an ``n`` > 1 request as they ended;
- the request's timestamps (`RequestMetrics`).

Tokens are the same as unmoved for greedy and seeded requests up to the last bits of the
recomputed logits (a prefill and a decode step compute the same position with other kernels,
as after a preemption); unseeded sampled requests draw from the receiving rank's global
generator, as they would after any rebatching.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from batchgen.engine.sequence import SequenceStatus
from batchgen.outputs import RequestMetrics

if TYPE_CHECKING:
    from batchgen.engine.sequence import Request, SequenceCoroutine

# Detokenizer attributes that are not state (the receiving engine sets its own).
_DETOKENIZER_SETUP = ("tokenizer", "prompt_token_ids")


@dataclass
class SequenceState:
    """One sample's progress. ``generator_state``: the seeded generator's bytes (None when
    unseeded). ``finished``: the sample ended on the source engine (``finish_reason`` set)."""

    index: int
    output_token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict] | None
    generator_state: bytes | None
    detokenizer_state: dict
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_preemptions: int


@dataclass
class RequestState:
    """A request's progress (`export_request`). ``num_computed_tokens``: tokens whose K/V the
    source engine held and drops (the receiving engine recomputes them)."""

    metrics: RequestMetrics
    seqs: list[SequenceState] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def started(self) -> bool:
        """Some sample generated a token or had K/V computed: moving it costs a recompute."""
        return self.num_computed_tokens > 0 or any(s.output_token_ids for s in self.seqs)


def export_request(request: Request) -> RequestState:
    """``request``'s progress as plain data (the engine's objects stay untouched)."""
    return RequestState(
        metrics=RequestMetrics(**vars(request.metrics)),
        seqs=[_export_seq(seq) for seq in request.seqs],
        num_computed_tokens=sum(s.num_computed_tokens for s in request.seqs),
    )


def _export_seq(seq: SequenceCoroutine) -> SequenceState:
    generator = seq.generator
    detok = {k: v for k, v in vars(seq.detokenizer).items() if k not in _DETOKENIZER_SETUP}
    detok["output_token_ids"] = list(detok["output_token_ids"])
    detok["_pieces"] = list(detok["_pieces"])
    return SequenceState(
        index=seq.index,
        output_token_ids=list(seq.output_token_ids),
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=None if seq.logprobs is None else list(seq.logprobs),
        generator_state=None if generator is None else generator.get_state().numpy().tobytes(),
        detokenizer_state=detok,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_preemptions=seq.num_preemptions,
    )


def restore_sequence(seq: SequenceCoroutine, state: SequenceState) -> None:
    """Give a fresh ``seq`` (built by `LLMEngine.add_processed_request`, not yet scheduled)
    the progress in ``state``. The caller queues it unless ``state.finished``."""
    if state.index != seq.index:
        raise ValueError(f"sample {seq.index} given the state of sample {state.index}")
    seq.output_token_ids = list(state.output_token_ids)
    seq.cumulative_logprob = state.cumulative_logprob
    if seq.logprobs is not None and state.logprobs is not None:
        seq.logprobs = list(state.logprobs)
    if state.generator_state is not None:
        if seq.generator is None:
            raise ValueError("a seeded sample's state given to an unseeded request")
        raw = torch.frombuffer(bytearray(state.generator_state), dtype=torch.uint8)
        seq.generator.set_state(raw)
    vars(seq.detokenizer).update(state.detokenizer_state)
    seq.num_preemptions = state.num_preemptions
    if state.finished:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = state.finish_reason, state.stop_reason
