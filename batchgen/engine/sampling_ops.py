"""The sampler's row-wise operations on logits: seeded generators, token counts and penalties,
the ``min_tokens`` mask, structured-output token bitmasks, top-k / top-p / min-p and the
exponential-race draw. `batchgen.engine.sampler.Sampler` applies them in vLLM v1's order (that
module's docstring); each is usable on its own.

Sources: vLLM v1 `vllm/v1/sample/ops/penalties.py`, `vllm/v1/sample/ops/topk_topp_sampler.py`,
`vllm/v1/sample/sampler.py`. Shape legend: B = rows, V = vocabulary size, R = random rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


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
    token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
    staging=None,
    field: str = "token_counts",
) -> torch.Tensor:
    """How often each token occurs in each row: ``[B, V]`` int64 (B = ``len(token_ids)``).

    Example: ``token_counts([[2, 2, 0], []], 4, "cpu")`` is ``[[1, 0, 2, 0], [0, 0, 0, 0]]``.
    Costs O(total tokens) Python work, so the sampler only builds it for rows with penalties.
    ``staging`` (a `batchgen.engine.host_staging.HostStaging` for ``device``, or None) sends
    the flat ids and row lengths (fields ``field + "_ids"`` / ``"_lengths"``); the row index
    is expanded on the device with a host-known ``output_size`` (no sync).
    """
    device = torch.device(device)
    counts = torch.zeros((len(token_ids), vocab_size), dtype=torch.int64, device=device)
    lengths = [len(ids) for ids in token_ids]
    total = sum(lengths)
    if total == 0:
        return counts
    flat = list(itertools.chain.from_iterable(token_ids))
    if staging is not None:
        flat_ids = staging.to_device(f"{field}_ids", flat)  # [total]
        lengths_t = staging.to_device(f"{field}_lengths", lengths)  # [B]
    else:
        flat_ids = torch.tensor(flat, dtype=torch.int64, device=device)
        lengths_t = torch.tensor(lengths, dtype=torch.int64, device=device)
    rows = torch.arange(len(token_ids), device=device)
    row_idx = torch.repeat_interleave(rows, lengths_t, output_size=total)  # [total]
    ones = torch.ones(total, dtype=torch.int64, device=device)
    counts.index_put_((row_idx, flat_ids), ones, accumulate=True)
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
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
    any_top_p: bool | None = None,
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
        max_top_k: the largest ``k`` in ``(0, V)`` among the rows (0: none), when the caller
            knows it on the host; None reads it from ``top_k`` (a host sync on CUDA).
        any_top_p: whether some row has ``top_p < 1``, when the caller knows it on the host;
            None reads it from ``top_p`` (a host sync on CUDA).

    Example: probs ``[0.5, 0.3, 0.15, 0.05]``, ``top_p = 0.7`` keeps the first two (0.8 >= 0.7);
    ``top_k = 3`` drops the last.
    """
    vocab_size = logits.shape[1]
    neg_inf = float("-inf")
    k = None
    enabled = None
    if top_k is not None:
        enabled = (top_k > 0) & (top_k < vocab_size)  # [B]
        if max_top_k is None:
            max_top_k = int(top_k[enabled].max()) if bool(enabled.any()) else 0
        if max_top_k > 0:
            k = torch.where(enabled, top_k, vocab_size)  # [B], V = keep everything
    if top_p is not None and any_top_p is None:
        any_top_p = bool((top_p < 1).any())
    if top_p is not None and not any_top_p:
        top_p = None
    if k is None and top_p is None:
        return logits

    if top_p is None:
        # Top-k alone: the k-th largest value per row from a partial top-k, no full sort.
        max_k = max_top_k
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
