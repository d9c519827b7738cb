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

A seeded row draws its ``q`` from its own generator, one ``[V]`` draw per step, and every other
step is row-wise, so its tokens depend only on its own logits and generator, never on its batch
mates. Greedy rows draw nothing.

Shape legend: B = rows (sequences) in the batch, V = vocabulary size, R = random rows,
L = rows that asked for logprobs, N = the largest ``logprobs`` among them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchgen.engine.logits_processors import apply_bad_words, apply_logit_bias
from batchgen.sampling_params import SamplingParams

# Floor for returned log-probabilities: -inf is not JSON and breaks sums (OpenAI uses -9999).
LOGPROB_FLOOR = -9999.0
_MASK64 = (1 << 64) - 1


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


def make_generator(seed: int, index: int, device: torch.device | str) -> torch.Generator:
    """The generator of sample ``index`` of a request with ``seed``, on ``device``.

    The generator seed is a SplitMix64 hash of ``(seed, index)``, so the samples of one request
    differ, the same ``(seed, index)`` always gives the same stream, and unlike vLLM v1's
    ``seed + index`` (parallel sampling) request ``seed=s`` sample 1 does not share its noise
    with request ``seed=s+1`` sample 0. Any Python int is accepted as ``seed``.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64)))
    return generator


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """How often each token occurs in each row: ``[B, V]`` int64 (B = ``len(token_ids)``).

    Example: ``token_counts([[2, 2, 0], []], 4, "cpu")`` is ``[[1, 0, 2, 0], [0, 0, 0, 0]]``.
    Costs O(total tokens) Python work, so the sampler only builds it for rows with penalties.
    """
    counts = torch.zeros((len(token_ids), vocab_size), dtype=torch.int64, device=device)
    lengths = [len(ids) for ids in token_ids]
    if sum(lengths) == 0:
        return counts
    row_idx = torch.repeat_interleave(torch.arange(len(token_ids)), torch.tensor(lengths))
    flat_ids = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
    ones = torch.ones(flat_ids.numel(), dtype=torch.int64, device=device)
    counts.index_put_((row_idx.to(device), flat_ids.to(device)), ones, accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Apply repetition, then frequency and presence penalties, in place (vLLM v1 order).

    Args:
        logits: ``[B, V]`` float32, modified in place and returned.
        prompt_mask: ``[B, V]`` bool, token occurs in the prompt.
        output_counts: ``[B, V]`` int, occurrences of the token in the generated output.
        repetition_penalties: ``[B]`` float32, > 0; for tokens seen in prompt *or* output a
            positive logit is divided by it and a non-positive one multiplied (CTRL / HF).
        frequency_penalties, presence_penalties: ``[B]`` float32; OpenAI's formula over output
            tokens only: ``logit -= frequency * count + presence * (count > 0)``.

    Example: logit 2.0 seen in the prompt, repetition 2 -> 1.0; logit -1.0 -> -2.0; a token
    generated 3 times with frequency 0.5 and presence 0.25 loses 1.75.
    """
    output_mask = output_counts > 0  # [B, V]
    seen = prompt_mask | output_mask  # [B, V]
    rep = repetition_penalties.unsqueeze(1)  # [B, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)  # [B, V]
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= frequency_penalties.unsqueeze(1) * output_counts
    logits -= presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_min_tokens(logits: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set ``logits[b, i] = -inf`` for every id ``i`` in ``block_ids[b]``, in place.

    Args:
        logits: ``[B, V]`` float32, modified in place and returned.
        block_ids: per row, the ids to forbid (empty when the row's ``min_tokens`` is reached);
            ids outside ``[0, V)`` are ignored.
    """
    vocab_size = logits.shape[1]
    pairs = [(b, i) for b, ids in enumerate(block_ids) for i in ids if 0 <= i < vocab_size]
    if pairs:
        index = torch.tensor(pairs, dtype=torch.int64, device=logits.device)  # [P, 2]
        logits[index[:, 0], index[:, 1]] = float("-inf")
    return logits


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, W]`` int32 bitmask -> ``[B, vocab_size]`` bool, True = allowed.

    Bit ``i % 32`` of word ``i // 32`` stands for token ``i`` (llguidance's and xgrammar's
    layout). Example: words ``[5]`` (bits 0 and 2) with ``vocab_size=4`` -> ``[T, F, T, F]``.
    """
    shifts = _BIT_SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [B, V]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of the tokens a row's grammar forbids to -inf, in place: one masked fill
    over the rows that are constrained (rows whose bitmask is all ones are left alone).

    Args:
        logits: ``[B, V]`` float32, modified in place and returned.
        bitmask: ``[B, ceil(V / 32)]`` int32 (`unpack_token_bitmask`), any device.
    """
    bitmask = bitmask.to(logits.device, non_blocking=True)
    constrained = (bitmask != -1).any(dim=1).nonzero().squeeze(1)  # [C]
    if constrained.numel() == 0:
        return logits
    allowed = unpack_token_bitmask(bitmask[constrained], logits.shape[1])  # [C, V]
    logits[constrained] = logits[constrained].masked_fill_(~allowed, float("-inf"))
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (set to -inf) the tokens outside each row's top-k and top-p sets, in place.

    Args:
        logits: ``[B, V]`` float32 (temperature already applied), modified in place and returned.
        top_k: ``[B]`` int64 or None; a row keeps the tokens whose logit is >= its k-th largest
            (ties with the k-th are kept, as in vLLM); ``k <= 0`` or ``k >= V`` disables it.
        top_p: ``[B]`` float32 in (0, 1] or None; after top-k, a row keeps the smallest set of
            most likely tokens whose cumulative probability reaches ``top_p``, i.e. it drops a
            token when the tokens ranked above it already hold ``>= top_p``. The most likely
            token is always kept; ``top_p = 1`` disables it.

    Example: probs ``[0.5, 0.3, 0.15, 0.05]``, ``top_p = 0.7`` keeps the first two (0.8 >= 0.7);
    ``top_k = 3`` drops the last.
    """
    vocab_size = logits.shape[1]
    neg_inf = float("-inf")
    k = None
    enabled = None
    if top_k is not None:
        enabled = (top_k > 0) & (top_k < vocab_size)  # [B]
        if bool(enabled.any()):
            k = torch.where(enabled, top_k, vocab_size)  # [B], V = keep everything
    if top_p is not None and not bool((top_p < 1).any()):
        top_p = None
    if k is None and top_p is None:
        return logits

    if top_p is None:
        # Top-k alone: the k-th largest value per row from a partial top-k, no full sort.
        max_k = int(top_k[enabled].max())
        top_values = logits.topk(max_k, dim=-1).values  # [B, max_k]
        kth = top_values.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))  # [B, 1]
        kth = kth.masked_fill((k >= vocab_size).unsqueeze(1), neg_inf)
        return logits.masked_fill_(logits < kth, neg_inf)

    # Stable sort so that ties are ordered by token id, the same in any batch.
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    if k is not None:
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, neg_inf)
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_above = probs.cumsum(dim=-1) - probs  # [B, V] exclusive cumsum
    drop = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)  # [B, V]
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, neg_inf)
    return logits.scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with ``prob < min_p * max_prob`` (probabilities of ``logits``), in place.

    Args:
        logits: ``[B, V]`` float32, modified in place and returned.
        min_p: ``[B]`` float32 in [0, 1]; 0 keeps every token. The most likely token is always
            kept.

    Example: probs ``[0.5, 0.3, 0.15, 0.05]``, ``min_p = 0.4`` -> threshold 0.2 keeps two.
    """
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def random_sample(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Draw one token per row from ``probs`` by the exponential race ``argmax(probs / q)``.

    Args:
        probs: ``[R, V]`` float32, rows need not be normalised; overwritten.
        generators: per row, its generator (one ``[V]`` Exp(1) draw from it per call) or None
            for the global RNG (one ``[R, V]`` draw per call, shared by all such rows).

    Returns:
        ``[R]`` int64 token ids.
    """
    q = torch.empty_like(probs)  # [R, V]
    if any(g is None for g in generators):
        q.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            q[row].exponential_(generator=generator)
    # Exp(1) may round to 0 in float32; 0/0 would be NaN, which argmax would pick.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return probs.div_(q).argmax(dim=-1)


class Sampler:
    """The engine's one sampler: ``Sampler()(logits, rows) -> SamplerOutput``.

    Stateless; all per-request state (token histories, generators) comes in ``rows``.
    """

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

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
        """Penalties for rows ``idx`` only; the other rows are left untouched."""
        vocab_size, device = logits.shape[1], logits.device
        params = [rows[b].params for b in idx]
        sub = logits[idx]  # [P, V]
        apply_penalties(
            sub,
            token_counts([rows[b].prompt_token_ids for b in idx], vocab_size, device) > 0,
            token_counts([rows[b].output_token_ids for b in idx], vocab_size, device),
            torch.tensor([p.repetition_penalty for p in params], device=device),
            torch.tensor([p.frequency_penalty for p in params], device=device),
            torch.tensor([p.presence_penalty for p in params], device=device),
        )
        logits[idx] = sub

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> torch.Tensor:
        """Greedy rows: argmax of ``logits``; random rows: temperature, top-k/p, min-p, draw.

        ``logits`` is ``[B, V]`` float32 after penalties; it is not modified. Returns ``[B]``.
        """
        device = logits.device
        random_idx = [b for b, g in enumerate(greedy) if not g]
        sampled = logits.argmax(dim=-1) if any(greedy) else None  # [B]
        if not random_idx:
            return sampled
        params = [rows[b].params for b in random_idx]
        if sampled is None:
            r_logits = logits.clone()  # [R, V], R = B
        else:
            r_logits = logits[random_idx]  # [R, V] (a copy)

        if any(p.temperature != 1.0 for p in params):
            temperature = torch.tensor([p.temperature for p in params], device=device)
            r_logits.div_(temperature.unsqueeze(1))
        top_k = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
        apply_top_k_top_p(r_logits, top_k, top_p)
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(r_logits, torch.tensor([p.min_p for p in params], device=device))

        r_sampled = random_sample(
            r_logits.softmax(dim=-1), [rows[b].generator for b in random_idx]
        )  # [R]
        if sampled is None:
            return r_sampled
        return sampled.index_copy_(0, torch.tensor(random_idx, device=device), r_sampled)

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
