"""A request leaving one engine and continuing in another (straggler rebalancing).

`export_request` captures, as plain picklable data, what a request's samples have produced so
far; `LLMEngine.release_request` takes the request out of its engine with it, and
`LLMEngine.add_processed_request(..., resume=state)` continues it elsewhere. A started sample's
K/V reaches the receiving engine one of two ways (the straggler rebalancer picks,
`batchgen.distributed.rebalance`):

- **shipped** (``export_request(..., kv_reader=...)``): the K/V of its computed positions travel
  as bytes (`KVPayload`, every layer's cache tensors: key and value, or MLA's latent and rope
  key); when the receiving scheduler admits the sample it allocates blocks, the engine writes
  the bytes into them (`import_kv`) before the step runs, and the sample goes on decoding. The
  K/V are the source's own bits, so the tokens are exactly the unmoved ones;
- **recomputed**: nothing of the KV cache travels; the receiving engine prefills the prompt and
  generated tokens again (the preemption path: ``num_computed_tokens`` starts at 0), then
  samples the next token.

What else travels makes the final `RequestOutput` the one an unmoved run gives:

- the generated token ids (the sampler's penalties see them, the prefill recomputes them);
- the seeded generator's state (``torch.Generator.get_state``): the next draw continues the
  sample's stream, so seeded sampling does not depend on the rank (a request's generator is
  its own, `batchgen.engine.sampler.make_generator`);
- logprobs and the cumulative logprob so far, the detokenizer's state (emitted text, offsets,
  stop-string tail), and finished samples of an ``n`` > 1 request as they ended;
- the request's timestamps (`RequestMetrics`).

With recompute, tokens are the same as unmoved for greedy and seeded requests up to the last
bits of the recomputed logits (a prefill and a decode step compute the same position with
other kernels, as after a preemption); unseeded sampled requests draw from the receiving
rank's global generator, as they would after any rebatching.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from batchgen.engine.sequence import SequenceStatus
from batchgen.models.layers.kv_cache_dtype import write_kv
from batchgen.outputs import RequestMetrics

if TYPE_CHECKING:
    from batchgen.engine.sequence import Request, SequenceCoroutine

# Detokenizer attributes that are not state (the receiving engine sets its own).
_DETOKENIZER_SETUP = ("tokenizer", "_backend_decode", "prompt_token_ids")


@dataclass
class KVPayload:
    """The K/V of a sample's first ``num_tokens`` positions, as bytes.

    ``data``: for each layer in order, for each of its cache tensors in order
    (`batchgen.models.decoder.kv_cache_token_shapes`: key and value ``[kv_heads, head_dim]``
    for GQA; latent ``[kv_lora_rank]`` and rope key ``[rope_dim]`` for MLA), the rows of
    positions ``0 .. num_tokens - 1``, ``dtype`` elements, concatenated. ``nbytes`` is its size.
    """

    num_tokens: int
    dtype: str
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def _slots(block_table: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Cache rows of positions ``[0, num_tokens)`` (``[num_tokens]`` int64)."""
    pos = torch.arange(num_tokens)
    blocks = torch.tensor(block_table, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def export_kv(
    kv_caches: list[tuple[torch.Tensor, ...]],
    block_size: int,
    block_table: list[int],
    num_tokens: int,
) -> KVPayload:
    """Copy positions ``[0, num_tokens)`` of a sample out of the paged caches.

    Args:
        kv_caches: per layer, its cache tensors ``[num_slots, *token_shape]``
            (`ModelRunner.kv_caches`), all of one dtype.
        block_table: the sample's KV block ids; ``block_size``: tokens per block.
    """
    slots = _slots(block_table, block_size, num_tokens).to(kv_caches[0][0].device)
    parts = [
        cache.index_select(0, slots).contiguous().view(torch.uint8).reshape(-1).cpu()
        for layer in kv_caches
        for cache in layer
    ]
    dtype = str(kv_caches[0][0].dtype).removeprefix("torch.")
    return KVPayload(num_tokens, dtype, torch.cat(parts).numpy().tobytes())


def import_kv(
    kv_caches: list[tuple[torch.Tensor, ...]],
    block_size: int,
    block_table: list[int],
    payload: KVPayload,
) -> None:
    """Write ``payload`` (from `export_kv` on an engine of the same model and KV dtype) into
    positions ``[0, payload.num_tokens)`` of ``block_table``.

    Raises:
        ValueError: the payload's dtype or size does not fit these caches.
    """
    dtype = str(kv_caches[0][0].dtype).removeprefix("torch.")
    n = payload.num_tokens
    sizes = [n * cache[0].numel() * cache.element_size() for layer in kv_caches for cache in layer]
    if payload.dtype != dtype or payload.nbytes != sum(sizes):
        raise ValueError(
            f"K/V payload of {payload.nbytes} bytes of {payload.dtype} does not fit this "
            f"engine's caches ({sum(sizes)} bytes of {dtype} for {n} tokens)"
        )
    raw = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8)
    slots = _slots(block_table, block_size, n).to(kv_caches[0][0].device)
    caches = [cache for layer in kv_caches for cache in layer]
    offset = 0
    for cache, size in zip(caches, sizes):
        rows = raw[offset : offset + size].view(cache.dtype).view(n, *cache.shape[1:])
        write_kv(cache, slots, rows.to(cache.device))  # fp8 caches as bytes
        offset += size


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
    kv: KVPayload | None = None  # shipped K/V of its computed positions, if any


@dataclass
class RequestState:
    """A request's progress (`export_request`). ``num_computed_tokens``: tokens whose K/V the
    source engine held for its unfinished samples and drops (the receiving engine recomputes
    those no `KVPayload` carries)."""

    metrics: RequestMetrics
    seqs: list[SequenceState] = field(default_factory=list)
    num_computed_tokens: int = 0
    # The prompt log-probabilities known so far (`Request.prompt_logprobs`), when asked for:
    # shipped K/V of the prompt would otherwise leave the receiver without their logits.
    prompt_logprobs: list | None = None

    @property
    def started(self) -> bool:
        """Some sample generated a token or had K/V computed: moving it costs a recompute."""
        return self.num_computed_tokens > 0 or any(s.output_token_ids for s in self.seqs)

    @property
    def num_shipped_tokens(self) -> int:
        """Computed positions whose K/V travel with the state (not recomputed)."""
        return sum(s.kv.num_tokens for s in self.seqs if s.kv is not None)

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv.nbytes for s in self.seqs if s.kv is not None)


KVReader = Callable[[list[int], int], KVPayload]


def export_request(request: Request, kv_reader: KVReader | None = None) -> RequestState:
    """``request``'s progress as plain data (the engine's objects stay untouched).

    ``kv_reader(block_table, num_tokens)``: given, every unfinished sample with computed
    positions ships their K/V (`export_kv`); otherwise the receiver recomputes them."""
    return RequestState(
        metrics=RequestMetrics(**vars(request.metrics)),
        seqs=[_export_seq(seq, kv_reader) for seq in request.seqs],
        num_computed_tokens=sum(_held_tokens(s) for s in request.seqs if not s.is_finished),
        prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs),
    )


def _held_tokens(seq: SequenceCoroutine) -> int:
    """Positions whose K/V this engine holds for ``seq``: computed, or shipped here and not
    yet admitted (``seq.kv_import``)."""
    if seq.kv_import is not None:
        return seq.kv_import.num_tokens
    return seq.num_computed_tokens


def _export_seq(seq: SequenceCoroutine, kv_reader: KVReader | None) -> SequenceState:
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
        kv=_export_kv(seq, kv_reader),
    )


def _export_kv(seq: SequenceCoroutine, kv_reader: KVReader | None) -> KVPayload | None:
    """The K/V ``seq`` takes along: K/V shipped here that it has not used yet (moved again
    while waiting) goes on as it is; computed K/V is read when ``kv_reader`` is given."""
    if seq.is_finished:
        return None
    if seq.kv_import is not None:
        return seq.kv_import
    if kv_reader is not None and seq.num_computed_tokens:
        return kv_reader(seq.block_table, seq.num_computed_tokens)
    return None


def restore_sequence(seq: SequenceCoroutine, state: SequenceState) -> None:
    """Give a fresh ``seq`` (built by `LLMEngine.add_processed_request`, not yet scheduled)
    the progress in ``state``. The caller queues it unless ``state.finished``; shipped K/V wait
    in ``seq.kv_import`` until the scheduler admits it."""
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
    if state.kv is not None and not state.finished:
        if state.kv.num_tokens >= seq.num_tokens:
            raise ValueError(
                f"K/V of {state.kv.num_tokens} positions shipped for a sample of "
                f"{seq.num_tokens} tokens (at most {seq.num_tokens - 1} can be computed)"
            )
        seq.kv_import = state.kv
    if state.finished:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = state.finish_reason, state.stop_reason
