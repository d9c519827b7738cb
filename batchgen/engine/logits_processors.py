"""Per-request logits processors that the sampler runs before its penalties, in this order:
vLLM's ``bad_words``, then OpenAI's ``logit_bias``.

Each one edits the ``[B, V]`` float32 logits copy in place, row by row, and touches only the
rows whose request asked for it, so a row's result never depends on its batch mates. vLLM v1
runs them in the same place (before penalties, temperature and top-k/top-p) and, like here,
its returned log-probabilities come from the raw logits, before any of them.

Shape legend: B = rows, V = vocabulary size, P = (row, token) pairs to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def apply_logit_bias(
    logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]
) -> torch.Tensor:
    """Add ``biases[b][token]`` to ``logits[b, token]``, in place.

    Args:
        logits: ``[B, V]`` float32, modified in place and returned.
        biases: per row, token id -> bias (`SamplingParams.logit_bias`), or None / ``{}`` for
            none. Ids outside ``[0, V)`` are ignored (the engine refuses such requests before).

    Example: logits ``[[1, 2, 3]]`` with ``[{0: 5.0, 2: -100.0}]`` -> ``[[6, 2, -97]]``.
    """
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for b, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            if 0 <= token < vocab_size:
                rows.append(b)
                cols.append(token)
                values.append(value)
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))  # [P]
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)
    return logits


def apply_bad_words(
    logits: torch.Tensor,
    bad_words: Sequence[Sequence[Sequence[int]]],
    past_tokens: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Ban (set to -inf) the last token of every bad word whose other tokens end the row's
    generated tokens, in place (vLLM's ``bad_words`` semantics).

    Args:
        logits: ``[B, V]`` float32, modified in place and returned.
        bad_words: per row, the token-id forms of its bad words
            (`SamplingParams.bad_words_token_ids`); a one-token form is always banned.
        past_tokens: per row, the tokens generated so far (the prompt does not count).
            Ids outside ``[0, V)`` are ignored.

    Example: forms ``[[7], [3, 4]]`` after generated ``[9, 3]`` ban 7 and 4; after ``[9]`` only 7.
    """
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for b, (forms, past) in enumerate(zip(bad_words, past_tokens, strict=True)):
        for form in forms:
            prefix = len(form) - 1
            if prefix > len(past) or not 0 <= form[-1] < vocab_size:
                continue
            if prefix == 0 or list(past[len(past) - prefix :]) == list(form[:-1]):
                rows.append(b)
                cols.append(form[-1])
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))  # [P]
        logits[index] = float("-inf")
    return logits
