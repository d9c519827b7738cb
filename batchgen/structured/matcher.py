"""Per-sample grammar state and the batch's token bitmask.

A `SequenceGrammar` is one sample's position in its grammar: advanced by every token the sample
accepts, asked each step which tokens may come next. The masks of a step's rows are written
into one ``[B, ceil(V / 32)]`` int32 bitmask (bit ``i % 32`` of word ``i // 32`` set = token
``i`` allowed; llguidance's and xgrammar's layout), which the sampler applies to the whole
batch's logits in one masked fill (`batchgen.engine.sampler.apply_token_bitmask`).

Preemption needs nothing here: a preempted sample keeps its generated tokens and recomputes
their K/V, so its grammar state stays right. A sample that continues on another engine
(`batchgen.engine.migration`) gets a fresh state and `replay`s its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from batchgen.structured.compiler import CompiledGrammar


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


class SequenceGrammar:
    """One sample's grammar state (a copy of its `CompiledGrammar`'s start state).

    Attributes:
        num_tokens: tokens accepted since the start state.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        if compiled.template is None:
            raise ValueError(compiled.error or "the grammar did not compile")
        self.key = compiled.key
        self._matcher: Any = compiled.template.deep_copy()
        self.num_tokens = 0

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token.

        Raises:
            ValueError: the grammar does not allow ``token_id`` here (the sampler only samples
                allowed tokens, so this means a bug or a sample that ignored the mask).
        """
        if not self._matcher.consume_token(token_id):
            raise ValueError(
                f"token {token_id} breaks the request's structured output grammar: "
                f"{self._matcher.get_error().strip()}"
            )
        self.num_tokens += 1

    def replay(self, token_ids: Sequence[int]) -> None:
        """Back to the start state, then accept ``token_ids`` (a recomputed sample's output).

        Raises:
            ValueError: the tokens do not follow the grammar.
        """
        self._matcher.reset()
        self.num_tokens = 0
        for token_id in token_ids:
            self.accept(token_id)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and nothing may follow: the sample ends here."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was generated so far is a complete sentence (EOS is allowed now)."""
        return self._matcher.is_accepting()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a CPU, contiguous int32
        ``[B, W]`` tensor)."""
        width = bitmask.shape[1]
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * width * 4, width * 4)


def fill_token_bitmask(
    grammars: Sequence[SequenceGrammar | None], vocab_size: int
) -> torch.Tensor | None:
    """The step's bitmask: ``[B, ceil(V / 32)]`` int32 on CPU, B = ``len(grammars)``; rows
    without a grammar allow every token. None when no row has a grammar.

    One call into the grammar engine per constrained row (each a few microseconds to ~0.1 ms
    of Rust, no per-token Python).
    """
    rows = [b for b, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    bitmask = torch.full((len(grammars), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    for b in rows:
        grammars[b].fill(bitmask, b)
    return bitmask
