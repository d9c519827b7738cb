"""The engine's structured-output bookkeeping (vLLM v1's ``StructuredOutputManager``).

`LLMEngine` asks it three things:

1. on arrival (`add`): compile this request's spec; if the grammar is ready (a cache hit), its
   samples get their `SequenceGrammar` now and go to the scheduler, else the request waits
   here while the compiler's worker thread builds the grammar and the engine's steps go on;
2. before each schedule (`take_ready`): the waiting requests whose grammar is now ready (or
   failed); when nothing else can run it waits for the first of them, so a step is never
   empty while a grammar compiles;
3. per step (`token_bitmask`): the bitmask of the step's rows.

A request that waits here has no KV blocks and no place in the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

from batchgen.structured.compiler import CompiledGrammar, GrammarCompiler
from batchgen.structured.grammar import GrammarError
from batchgen.structured.matcher import SequenceGrammar, fill_token_bitmask

if TYPE_CHECKING:
    import torch

    from batchgen.engine.sequence import Request, SequenceCoroutine


class StructuredOutputManager:
    """Args: as `GrammarCompiler` (the model's tokenizer, vocabulary size and EOS ids)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.waiting: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        # Ids of the constrained requests in the engine: without any, a step skips the bitmask.
        self.live: set[str] = set()

    def add(self, request: Request) -> bool:
        """Start compiling ``request``'s grammar. True when its samples have their grammar
        states now (the caller queues them), False when it waits for `take_ready`, which
        also reports a grammar that failed (even one known to fail from the cache), so that
        every caller of the engine gets the failure the same way: in the request's output.
        Never raises for a bad spec."""
        self.live.add(request.request_id)
        future = self.compiler.submit(request.params.structured_outputs)
        if future.done():
            try:
                _attach(request, future.result())
                return True
            except GrammarError:
                pass  # failed by the next `take_ready`
        self.waiting[request.request_id] = (request, future)
        return False

    def take_ready(self, block: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The waiting requests whose grammar is done: ``(ready, failed)``, ``ready`` with
        grammar states attached, ``failed`` as ``(request, why)``. With ``block``, waits until
        at least one is done (when some are waiting)."""
        if block and self.waiting:
            wait([f for _, f in self.waiting.values()], return_when=FIRST_COMPLETED)
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for request_id, (request, future) in list(self.waiting.items()):
            if not future.done():
                continue
            del self.waiting[request_id]
            try:
                _attach(request, future.result())
            except GrammarError as err:
                failed.append((request, str(err)))
            else:
                ready.append(request)
        return ready, failed

    def release(self, request_id: str) -> None:
        """Forget a request that left the engine (finished, failed or aborted); unknown ids are
        ignored."""
        self.waiting.pop(request_id, None)
        self.live.discard(request_id)

    def token_bitmask(self, seqs: Sequence[SequenceCoroutine]) -> torch.Tensor | None:
        """``[B, ceil(V / 32)]`` int32 for the step's rows ``seqs`` (`fill_token_bitmask`);
        None when none of them is constrained."""
        return fill_token_bitmask([s.grammar for s in seqs], self.vocab_size)


def _attach(request: Request, compiled: CompiledGrammar) -> None:
    """Give each unfinished sample of ``request`` its own grammar state, replaying the tokens
    it already has (a request resumed from another engine)."""
    if compiled.template is None:
        raise GrammarError(compiled.error or "the grammar did not compile")
    for seq in request.seqs:
        if seq.is_finished:
            continue
        seq.grammar = SequenceGrammar(compiled)
        try:
            seq.grammar.replay(seq.output_token_ids)
        except ValueError as exc:
            raise GrammarError(f"resumed tokens do not follow the grammar: {exc}") from None
