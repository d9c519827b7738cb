"""Prompt log-probabilities (vLLM's ``SamplingParams.prompt_logprobs``): which positions of a
prefill chunk need their logits, and the top-N entries computed from their hidden states.

The logits at position ``p`` predict token ``p + 1``, so prompt token ``i >= 1`` takes its
entry from position ``i - 1``, and positions ``0 .. P - 2`` of a ``P``-token prompt are needed
(position ``P - 1`` predicts the first generated token, which the sampler handles). Entries
are filled in prompt order by whichever sample computes the positions first; a recompute
(preemption, a second sample prefilling the same prompt) skips the known ones. A position whose
K/V a sample took from another sequence's cache was never computed by it and has no logits:
the scheduler therefore shares no prompt K/V with a request while ``Request.needs_prompt_logits``
(`batchgen.engine.scheduler`), and a moved request carries its entries along
(`batchgen.engine.migration.RequestState.prompt_logprobs`).

Like the sampler's ``logprobs`` these are the raw model distribution (``log_softmax`` of the
float32 logits), floored at -9999. Shape legend: n = positions of one chunk, H = hidden size,
V = vocabulary size, N = ``prompt_logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.engine.sampler import LOGPROB_FLOOR
from batchgen.engine.sequence import SequenceCoroutine
from batchgen.outputs import Logprob

# Rows whose [rows, V] float32 logits exist at once (a 128k vocabulary: 128 MiB per 256 rows).
LOGITS_CHUNK_ROWS = 256


def prompt_logit_positions(seq: SequenceCoroutine, num_new_tokens: int) -> range:
    """The positions of ``seq``'s next chunk (``num_new_tokens`` from ``num_computed_tokens``)
    whose logits its request's prompt log-probabilities still need; empty when none.

    Example: a 6-token prompt, entries known for tokens 0..2 (3 entries), a chunk of positions
    1..4 -> ``range(2, 5)`` (position 2 gives token 3's entry, position 4 token 5's).
    """
    known = seq.request.prompt_logprobs
    if known is None:
        return range(0)
    start = seq.num_computed_tokens
    first = max(start, len(known) - 1)
    end = min(start + num_new_tokens, seq.num_prompt_tokens - 1)
    return range(first, end) if first < end else range(0)


def add_prompt_logprobs(
    seq: SequenceCoroutine,
    positions: range,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    decode: Callable[[list[int]], str],
) -> None:
    """Append the entries of prompt tokens ``positions + 1`` to ``seq.request.prompt_logprobs``.

    Args:
        seq: the sample that computed ``positions``; its request asked for prompt logprobs.
        positions: from `prompt_logit_positions`, taken before the chunk ran.
        hidden: ``[n, H]``, the final hidden states at ``positions`` (n = ``len(positions)``).
        compute_logits: ``[r, H] -> [r, V]`` float32 (the model's norm and LM head).
        decode: token ids -> text, for ``Logprob.decoded_token``.

    Raises:
        RuntimeError: ``positions`` does not continue the known entries (a position was taken
            from a cache without its logits): the request fails instead of returning a gap.
    """
    request = seq.request
    known = request.prompt_logprobs
    if positions.start != len(known) - 1:
        raise RuntimeError(
            f"prompt logprobs of positions {positions.start}.. requested with only "
            f"{len(known)} entries known: prompt positions were skipped without their logits"
        )
    k = request.params.prompt_logprobs
    actual = request.prompt_token_ids[positions.start + 1 : positions.stop + 1]
    for lo in range(0, len(actual), LOGITS_CHUNK_ROWS):
        rows = hidden[lo : lo + LOGITS_CHUNK_ROWS]
        tokens = torch.tensor(actual[lo : lo + LOGITS_CHUNK_ROWS], device=rows.device)  # [r]
        known.extend(_entries(compute_logits(rows).float(), tokens, k, decode))


def _entries(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, decode: Callable[[list[int]], str]
) -> list[dict[int, Logprob]]:
    """Per row of ``logits [r, V]``: the top ``k`` tokens by rank, then ``tokens[row]`` with its
    rank when it is not among them."""
    lse = logits.logsumexp(dim=-1, keepdim=True)  # [r, 1]
    actual_logits = logits.gather(1, tokens.unsqueeze(1))  # [r, 1]
    ranks = ((logits > actual_logits).sum(dim=-1) + 1).tolist()  # ties rank as high as they can
    actual_lp = _floor(actual_logits.squeeze(1) - lse.squeeze(1)).tolist()  # [r]
    values, ids = logits.topk(min(k, logits.shape[1]), dim=-1)  # [r, N]
    top_lp, ids = _floor(values - lse).tolist(), ids.tolist()
    out = []
    for row, token in enumerate(tokens.tolist()):
        entry = {
            t: Logprob(lp, rank + 1, decode([t]))
            for rank, (t, lp) in enumerate(zip(ids[row], top_lp[row], strict=True))
        }
        if token not in entry:
            entry[token] = Logprob(actual_lp[row], ranks[row], decode([token]))
        out.append(entry)
    return out


def _floor(logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs.nan_to_num(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
