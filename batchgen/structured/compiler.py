"""Grammars compiled against one model's vocabulary, once per distinct spec, off the step loop.

`GrammarCompiler.submit(spec)` returns a future of a `CompiledGrammar`: a pristine llguidance
matcher for the spec (its start state), which every sample of every request with the same spec
copies (`LLMatcher.deep_copy`, about 20 us against 2-10 ms for a compile). Compiles run on one
worker thread (llguidance drops the GIL while it builds a grammar), so a request waits for its
grammar and the engine's steps go on meanwhile. Results, failures included, stay in a bounded
LRU cache keyed by `StructuredOutputsParams.key`, so a batch of a million lines with a handful
of schemas compiles a handful of times and a bad spec repeated on many lines fails each of them
without another compile.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from batchgen.structured.grammar import GrammarError, grammar_text
from batchgen.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Distinct compiled specs kept (each a matcher of a few KB to a few MB for large schemas).
DEFAULT_CACHE_SIZE = 256


@dataclass
class CompiledGrammar:
    """A spec compiled for this vocabulary: ``template`` (an ``llguidance.LLMatcher`` in its
    start state, never advanced itself) or ``error`` (why it cannot run: the message names the
    field as ``structured_outputs.<kind>``)."""

    key: tuple[str, str]
    template: Any = None
    error: str | None = None


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; thread-safe.

    Args:
        tokenizer: the model's Hugging Face tokenizer (a fast one: llguidance reads its
            ``tokenizer.json``; byte-level BPE, SentencePiece-style byte-fallback and
            tiktoken-converted vocabularies all are).
        vocab_size: the model's vocabulary (logits) size; ids past the tokenizer's are never
            allowed.
        eos_token_ids: the ids that end a sequence; a grammar allows them once it is complete.
        cache_size: distinct specs kept compiled (least recently used dropped first).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.num_compiles = 0
        self._lltokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A future of ``spec`` compiled: already done on a cache hit, else compiling on the
        worker thread (one compile per spec however many requests ask for it meanwhile)."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                done: Future[CompiledGrammar] = Future()
                done.set_result(hit)
                return done
            future = self._pending.get(key)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchgen-grammar")
                future = self._pool.submit(self._compile_and_store, key)
                self._pending[key] = future
            return future

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """``spec`` compiled, waiting for it (`submit(spec).result()`)."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile_and_store(self, key: tuple[str, str]) -> CompiledGrammar:
        try:
            compiled = self._compile(key)
        except Exception as exc:  # a grammar engine failure fails the requests, not the engine
            logger.exception("compiling a %s grammar failed", key[0])
            compiled = CompiledGrammar(
                key,
                error=f"compiling structured_outputs.{key[0]} failed: {type(exc).__name__}: {exc}",
            )
        with self._lock:
            self._pending.pop(key, None)
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        from llguidance import LLMatcher

        kind = key[0]
        try:
            text = grammar_text(*key)
        except GrammarError as err:
            return CompiledGrammar(key, error=str(err))
        self.num_compiles += 1
        matcher = LLMatcher(self._llguidance_tokenizer(), text, log_level=0)
        if matcher.is_error():
            return CompiledGrammar(
                key, error=f"structured_outputs.{kind} is invalid: {matcher.get_error().strip()}"
            )
        if not any(matcher.compute_bitmask()):
            return CompiledGrammar(
                key,
                error=f"structured_outputs.{kind} cannot be matched: no token of this model's "
                "vocabulary can start it",
            )
        return CompiledGrammar(key, template=matcher)

    def _llguidance_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (on the worker thread: about
        10 ms for 512 tokens, 0.7 s for 32k)."""
        if self._lltokenizer is None:
            import llguidance.hf

            self._lltokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._lltokenizer
