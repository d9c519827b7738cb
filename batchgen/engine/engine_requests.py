"""`LLMEngine`'s request methods (a mixin of `LLMEngine`): taking requests in (validated by
`InputProcessor`, one `SequenceCoroutine` per sample), handing one over to another engine with
its progress (`release_request`, straggler rebalancing), the load report that decides such
moves, aborting, and what unfinished requests have generated so far.

It uses `LLMEngine`'s ``requests``, ``input_processor``, ``scheduler``, ``structured``,
``tokenizer``, ``device``, ``runner``, ``max_model_len``, ``_arrivals``, ``_next_seq_id`` and
``_grammar_failed``.
"""

from __future__ import annotations

from batchgen.engine.detokenizer import IncrementalDetokenizer
from batchgen.engine.input_processor import ProcessedPrompt
from batchgen.engine.migration import RequestState, export_kv, export_request, restore_sequence
from batchgen.engine.sampler import make_generator
from batchgen.engine.sequence import Request, SequenceCoroutine, SequenceStatus
from batchgen.outputs import RequestMetrics
from batchgen.sampling_params import SamplingParams


class EngineRequests:
    """`LLMEngine`'s request methods (see the module docstring)."""

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        *,
        max_tokens_must_fit: bool = False,
    ) -> None:
        """Queue a request.

        Args:
            max_tokens_must_fit: reject a request whose prompt plus ``max_tokens`` exceeds
                ``max_model_len`` (the OpenAI API's behaviour, used by the batch and HTTP
                paths); by default such a request runs and ends with ``finish_reason="length"``
                at ``max_model_len`` (vLLM's offline behaviour).

        Raises:
            ValueError: duplicate ``request_id``, empty prompt, prompt of ``max_model_len``
                tokens or more, token ids outside the vocabulary, text that cannot be
                tokenized, or (with ``max_tokens_must_fit``) a completion that cannot fit.
                Nothing is queued then.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = self.input_processor.process(
            prompt, params, max_tokens_must_fit=max_tokens_must_fit
        )
        self.add_processed_request(request_id, processed, params)

    def add_processed_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        resume: RequestState | None = None,
    ) -> None:
        """Queue a request whose prompt `InputProcessor.process` has already validated (the
        data-parallel ranks get requests this way from the frontend).

        A request with ``params.structured_outputs`` waits (without KV blocks) until its
        grammar is compiled (`batchgen.structured.manager`), unless it is cached already; a
        grammar that does not compile for this vocabulary fails the request in the next step
        (its output's ``error``), like any per-request failure. A resumed request's samples
        replay their tokens through a fresh grammar state.

        Args:
            arrival_time: when the request arrived (``time.time()`` seconds), for
                `RequestMetrics`; default now.
            resume: the request's progress on another engine (`release_request` there): its
                unfinished samples are recomputed and continue where they stopped
                (`batchgen.engine.migration`).

        Raises:
            ValueError: duplicate ``request_id``, or a ``resume`` state that does not fit the
                request (another ``n``, seeded state for an unseeded request).
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = processed.prompt, processed.prompt_token_ids
        if resume is not None and len(resume.seqs) != params.n:
            raise ValueError(f"resume state of {len(resume.seqs)} samples for n={params.n}")
        request = Request(request_id, text, ids, params, self._arrivals)
        if resume is not None:
            request.metrics = RequestMetrics(**vars(resume.metrics))
            if resume.prompt_logprobs is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs = list(resume.prompt_logprobs)
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        self._arrivals += 1
        for i in range(params.n):
            seq = SequenceCoroutine(self._next_seq_id, request, i)
            self._next_seq_id += 1
            if params.seed is not None:
                seq.generator = make_generator(params.seed, i, self.device)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
                detokenize=params.detokenize,
            )
            if params.logprobs is not None:
                seq.logprobs = []
            if resume is not None:
                restore_sequence(seq, resume.seqs[i])
            request.seqs.append(seq)
        if params.structured_outputs is None or self.structured.add(request):
            self._queue(request)
        self.requests[request_id] = request

    def _queue(self, request: Request) -> None:
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.add(seq)

    def release_request(self, request_id: str, ship_kv: bool = False) -> RequestState | None:
        """Take an unfinished request out of this engine with its progress, to continue on
        another (`add_processed_request(..., resume=...)`); its KV blocks are freed. None when
        the request is unknown (finished and returned, or aborted). ``ship_kv``: the state
        carries the K/V of every computed position (`batchgen.engine.migration.KVPayload`),
        so the receiver need not recompute them."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        runner = self.runner

        def read(block_table: list[int], num_tokens: int):
            return export_kv(runner.kv_caches, runner.block_size, block_table, num_tokens)

        state = export_request(request, read if ship_kv else None)
        self.abort_request(request_id)
        return state

    def load_report(self) -> list[tuple[str, int, int, bool]]:
        """``(request_id, remaining_tokens, computed_tokens, running)`` per unfinished request,
        for straggler rebalancing: tokens still to compute (uncomputed prompt and generated
        tokens, plus ``max_tokens`` left, capped at ``max_model_len``; an upper bound when a
        sample may stop early), tokens whose K/V this engine holds, and whether a sample is
        running."""
        out = []
        for request_id, request in self.requests.items():
            remaining = computed = 0
            running = False
            limit = request.params.max_tokens
            for seq in request.seqs:
                if seq.is_finished:
                    continue
                room = self.max_model_len - seq.num_tokens
                left = room if limit is None else min(limit - seq.num_output_tokens, room)
                held = seq.num_computed_tokens or (
                    seq.kv_import.num_tokens if seq.kv_import is not None else 0
                )  # shipped here, not admitted yet: held all the same
                remaining += seq.num_tokens - held + max(0, left)
                computed += held
                running = running or seq.status is SequenceStatus.RUNNING
            out.append((request_id, remaining, computed, running))
        return out

    def abort_request(self, request_id: str) -> None:
        """Drop a request (no output is returned for it). Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.structured.release(request_id)
        self._grammar_failed.pop(request_id, None)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self.scheduler.remove_finished()

    def get_partial_texts(self, request_id: str) -> dict[int, str] | None:
        """Text generated so far by each sample (``{index: text}``) of an unfinished request,
        for streaming; None when the request is unknown or already returned. The text never
        ends in an incomplete UTF-8 character, but a stop string may still cut its tail."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return {seq.index: seq.detokenizer.output_text for seq in request.seqs}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)
