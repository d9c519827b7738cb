"""Per-request logits processors that the sampler runs before its penalties: OpenAI's
``logit_bias``.

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
