"""One batched sampler: logit bias, penalties, min_tokens, structured-output token masks,
temperature, top-k / top-p / min-p, per-sample seeded sampling and log-probabilities.

The semantics follow vLLM v1 (`vllm/v1/sample/sampler.py`, `vllm/v1/sample/ops/penalties.py`,
`vllm/v1/sample/ops/topk_topp_sampler.py`):

1. log-probabilities come from the *raw* logits (vLLM v1's default ``logprobs_mode``);
2. all processing runs in float32 on a copy of the logits;
3. the per-request logits processors (`batchgen.engine.logits_processors`: ``bad_words``,
   then ``logit_bias``),
   then repetition penalty (prompt and output tokens), then frequency and presence penalties
   (output tokens only), then the ``min_tokens`` mask, then the structured-output grammar
   masks (one ``[B, ceil(V / 32)]`` int32 bitmask for the batch, `apply_token_bitmask`);
4. greedy rows take the argmax of these processed logits;
5. random rows: temperature, top-k, top-p, min-p (vLLM v1 applies min-p before top-k/top-p; the
   two orders differ only when a row sets both ``top_p < 1`` and ``min_p > 0``), then one
   exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``, which is an exact draw from ``probs``
   (the Gumbel-max trick in multiplicative form).

The per-row parameter tensors (temperature, top-k, top-p, min-p, the three penalties, the
penalised and random row indices, the penalties' token counts) go to the device through
the engine's `HostStaging` when one is given (pinned buffers and asynchronous copies on CUDA,
so that the host queues the whole sampler without waiting for the forward pass; plain
``torch.tensor`` on CPU). Still built with ``torch.tensor``: the sparse index lists of
``logit_bias``, ``bad_words`` and ``min_tokens`` (rare rows), and the logprob rows' index
(the ``tolist`` that ends the step follows it at once).

A seeded row draws its ``q`` from its own generator, one ``[V]`` draw per step, and every other
step is row-wise, so its tokens depend only on its own logits and generator, never on its batch
mates. Greedy rows draw nothing.

Shape legend: B = rows (sequences) in the batch, V = vocabulary size, R = random rows,
L = rows that asked for logprobs, N = the largest ``logprobs`` among them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchgen.engine.host_staging import HostStaging
from batchgen.engine.logits_processors import apply_bad_words, apply_logit_bias
from batchgen.engine.sampling_ops import (  # noqa: F401 (re-exported: the sampler's public ops)
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_token_bitmask,
    apply_top_k_top_p,
    make_generator,
    random_sample,
    token_counts,
    unpack_token_bitmask,
)
from batchgen.sampling_params import SamplingParams

# Floor for returned log-probabilities: -inf is not JSON and breaks sums (OpenAI uses -9999).
LOGPROB_FLOOR = -9999.0


@dataclass
class SamplingRow:
    """One row of the logits: one sequence (sample) being generated.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (counts for the repetition penalty).
        output_token_ids: tokens generated so far for this sample (count for all penalties and
            for ``min_tokens``).
        generator: this sample's generator, on the logits' device, when ``params.seed`` is set
            (see `make_generator`); None draws from the global RNG.
        min_tokens_block_ids: ids forbidden while ``len(output_token_ids) < params.min_tokens``
            (the model's EOS ids and ``params.stop_token_ids``); ids outside ``[0, V)`` are
            ignored.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    min_tokens_block_ids: Sequence[int] = ()

    @property
    def min_tokens_active(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens and bool(
            self.min_tokens_block_ids
        )


@dataclass
class SamplerOutput:
    """What one sampler step returns, as plain Python values (one device sync).

    Attributes:
        sampled_token_ids: ``[B]`` the chosen token of each row.
        sampled_logprobs: ``[B]`` natural-log probability of that token under the raw model
            distribution (``log_softmax`` of the unprocessed logits), floored at -9999; None
            when the caller asked for none (``sampled_logprobs=False``: no row wants them).
        top_logprobs: per row, None when ``params.logprobs`` is None, else a list of
            ``(token_id, logprob, rank)`` sorted by rank (1 = most likely): the top
            ``params.logprobs`` tokens, then the sampled token with its true rank if it is not
            among them (so ``logprobs=0`` gives just the sampled token).
    """

    sampled_token_ids: list[int]
    sampled_logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float, int]] | None]


class Sampler:
    """The engine's one sampler: ``Sampler()(logits, rows) -> SamplerOutput``.

    Holds no request state: all of it (token histories, generators) comes in ``rows``.

    Args:
        staging: the `HostStaging` (normally the model runner's) that sends the per-row
            parameter tensors to the device; used for logits on its device, else (None, or
            logits elsewhere) they are built with ``torch.tensor``.
    """

    def __init__(self, staging: HostStaging | None = None) -> None:
        self.staging = staging

    def _staging_for(self, device: torch.device) -> HostStaging | None:
        """The staging if it serves ``device``, else None."""
        s = self.staging
        if s is not None and s.device.type == device.type and (
            s.device.index is None or s.device.index == device.index
        ):
            return s
        return None

    def _to_device(
        self, field: str, values: list, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``values`` as a ``[len(values)]`` tensor of ``dtype`` on ``device``, staged where
        the staging serves ``device`` (``field`` prefixed ``sampler_`` in its slots)."""
        s = self._staging_for(device)
        if s is not None:
            return s.to_device(f"sampler_{field}", values, dtype)
        return torch.tensor(values, dtype=dtype, device=device)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        token_bitmask: torch.Tensor | None = None,
        sampled_logprobs: bool = True,
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` any float dtype, any device; not modified.
            rows: ``B`` rows, ``rows[b]`` describing ``logits[b]``.
            token_bitmask: ``[B, ceil(V / 32)]`` int32, the tokens each row's structured-output
                grammar allows (`apply_token_bitmask`; all ones for an unconstrained row), or
                None. A constrained row only ever samples an allowed token.
            sampled_logprobs: compute every row's sampled-token log-probability. False (the
                engine's choice when no row asked for ``logprobs``) skips the ``logsumexp``
                over the whole vocabulary: ``SamplerOutput.sampled_logprobs`` is then None;
                rows that ask for ``logprobs`` get their ``top_logprobs`` either way.

        Returns:
            The sampled ids, their raw-model log-probabilities and the requested top-N lists.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [B, V] with B = len(rows) = {len(rows)}, got {tuple(logits.shape)}"
            )
        raw = logits.float()  # [B, V]; may alias `logits`, never written
        greedy = [row.params.is_greedy for row in rows]
        penalised = [b for b, row in enumerate(rows) if row.params.has_penalties]
        min_tokens = any(row.min_tokens_active for row in rows)
        biased = any(row.params.logit_bias for row in rows)
        banned = any(row.params.bad_words for row in rows)

        masked = token_bitmask is not None
        processors = biased or banned
        if all(greedy) and not penalised and not min_tokens and not masked and not processors:
            sampled = raw.argmax(dim=-1)  # [B] greedy fast path
        else:
            copy = penalised or min_tokens or masked or processors
            processed = raw.clone() if copy else raw  # [B, V]
            if banned:
                forms = [row.params.bad_words_token_ids for row in rows]
                apply_bad_words(processed, forms, [row.output_token_ids for row in rows])
            if biased:
                apply_logit_bias(processed, [row.params.logit_bias for row in rows])
            if penalised:
                self._apply_penalties(processed, rows, penalised)
            if min_tokens:
                block = [row.min_tokens_block_ids if row.min_tokens_active else () for row in rows]
                apply_min_tokens(processed, block)
            if masked:
                apply_token_bitmask(processed, token_bitmask)
            sampled = self._sample(processed, rows, greedy)
            # A row left with no finite logit (everything masked, or NaN) falls back to the
            # argmax of the raw logits instead of a NaN draw; a constrained row to the argmax
            # of the raw logits its grammar allows (min_tokens yields to the grammar).
            dead = ~torch.isfinite(processed.amax(dim=-1))  # [B]
            fallback = raw
            if masked and bool(dead.any()):
                fallback = apply_token_bitmask(raw.clone(), token_bitmask)
            sampled = torch.where(dead, fallback.argmax(dim=-1), sampled)

        if not sampled_logprobs and all(row.params.logprobs is None for row in rows):
            return SamplerOutput(sampled.tolist(), None, [None] * len(rows))
        out = self._make_output(raw, sampled, rows)
        if not sampled_logprobs:
            out.sampled_logprobs = None
        return out

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]):
        """Penalties for rows ``idx`` only; the other rows are left untouched."""
        vocab_size, device = logits.shape[1], logits.device
        params = [rows[b].params for b in idx]
        f32, stage = torch.float32, self._staging_for(device)
        idx_t = self._to_device("penalty_rows", idx, torch.long, device)  # [P]
        sub = logits.index_select(0, idx_t)  # [P, V]
        prompts = [rows[b].prompt_token_ids for b in idx]
        outputs = [rows[b].output_token_ids for b in idx]
        apply_penalties(
            sub,
            token_counts(prompts, vocab_size, device, stage, "sampler_prompt") > 0,
            token_counts(outputs, vocab_size, device, stage, "sampler_output"),
            self._to_device("repetition_penalty", [p.repetition_penalty for p in params], f32,
                            device),  # fmt: skip
            self._to_device("frequency_penalty", [p.frequency_penalty for p in params], f32,
                            device),  # fmt: skip
            self._to_device("presence_penalty", [p.presence_penalty for p in params], f32,
                            device),  # fmt: skip
        )
        logits.index_copy_(0, idx_t, sub)

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]
    ) -> torch.Tensor:
        """Greedy rows: argmax of ``logits``; random rows: temperature, top-k/p, min-p, draw.

        ``logits`` is ``[B, V]`` float32 after penalties; it is not modified. Returns ``[B]``.
        """
        device = logits.device
        random_idx = [b for b, g in enumerate(greedy) if not g]
        sampled = logits.argmax(dim=-1) if any(greedy) else None  # [B]
        if not random_idx:
            return sampled
        params = [rows[b].params for b in random_idx]
        f32, stage = torch.float32, self._to_device
        if sampled is None:
            r_logits = logits.clone()  # [R, V], R = B
        else:
            random_rows = stage("random_rows", random_idx, torch.long, device)  # [R]
            r_logits = logits.index_select(0, random_rows)  # [R, V] (a copy)

        if any(p.temperature != 1.0 for p in params):
            temperature = stage("temperature", [p.temperature for p in params], f32, device)
            r_logits.div_(temperature.unsqueeze(1))
        top_k = None
        if any(p.top_k > 0 for p in params):
            top_k = stage("top_k", [p.top_k for p in params], torch.int64, device)
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = stage("top_p", [p.top_p for p in params], f32, device)
        # bounds known on the host: no read of the tensors (a sync on CUDA)
        vocab = logits.shape[1]
        max_top_k = max((p.top_k for p in params if 0 < p.top_k < vocab), default=0)
        apply_top_k_top_p(r_logits, top_k, top_p, max_top_k, any_top_p=top_p is not None)
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(r_logits, stage("min_p", [p.min_p for p in params], f32, device))

        r_sampled = random_sample(
            r_logits.softmax(dim=-1), [rows[b].generator for b in random_idx]
        )  # [R]
        if sampled is None:
            return r_sampled
        return sampled.index_copy_(0, random_rows, r_sampled)

    @staticmethod
    def _make_output(
        raw: torch.Tensor, sampled: torch.Tensor, rows: list[SamplingRow]
    ) -> SamplerOutput:
        """Log-probabilities of the raw distribution: the sampled token's for every row, the
        top-N (and the sampled token's rank) only for rows that asked."""
        lse = raw.logsumexp(dim=-1)  # [B]
        sampled_logits = raw.gather(1, sampled.unsqueeze(1)).squeeze(1)  # [B]
        sampled_lp = _floor(sampled_logits - lse)  # [B]
        top: list[list[tuple[int, float, int]] | None] = [None] * len(rows)

        want = [b for b, row in enumerate(rows) if row.params.logprobs is not None]
        if want:
            # not staged: the ``tolist`` below waits for the stream right after anyway
            idx = torch.tensor(want, device=raw.device)
            sub = raw[idx]  # [L, V]
            # Rank 1 = most likely; ties with the sampled token rank it as high as they can.
            ranks = (sub > sampled_logits[idx].unsqueeze(1)).sum(dim=-1) + 1  # [L]
            max_n = max(rows[b].params.logprobs for b in want)
            values, ids = sub.topk(min(max_n, sub.shape[1]), dim=-1)  # [L, N]
            top_lp = _floor(values - lse[idx].unsqueeze(1))  # [L, N]
            ranks_l, ids_l, top_lp_l = ranks.tolist(), ids.tolist(), top_lp.tolist()
            sampled_l, sampled_lp_l = sampled[idx].tolist(), sampled_lp[idx].tolist()
            for j, b in enumerate(want):
                n = rows[b].params.logprobs
                entries = [
                    (ids_l[j][r], top_lp_l[j][r], r + 1) for r in range(min(n, len(ids_l[j])))
                ]
                if all(tok != sampled_l[j] for tok, _, _ in entries):
                    entries.append((sampled_l[j], sampled_lp_l[j], ranks_l[j]))
                top[b] = entries

        return SamplerOutput(sampled.tolist(), sampled_lp.tolist(), top)


def _floor(logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs.nan_to_num(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
