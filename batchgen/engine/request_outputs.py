"""Sampling a step's rows and turning tokens into outputs, with per-request failure
isolation: the half of `LLMEngine.execute` after the model forward.

`RequestOutputs` is a mixin of `LLMEngine` (it uses the engine's scheduler, sampler,
tokenizer, metrics and request table); the rules it follows are in the failure-isolation part
of `batchgen.engine.llm_engine`'s docstring:

* sampling is batched; if the batched call raises, it is retried request by request with the
  seeded generators rewound, so the other requests draw what they would have;
* a request whose rows, token handling or output raise fails alone (``RequestOutput.error``);
* a failed model forward fails the requests of that step (`_fail_step`).
"""

from __future__ import annotations

import logging
import time

import torch

from batchgen.engine.prompt_logprobs import add_prompt_logprobs
from batchgen.engine.sampler import SamplerOutput, SamplingRow
from batchgen.engine.scheduler import ScheduledSeq
from batchgen.engine.sequence import Request, SequenceCoroutine
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger("batchgen.engine.llm_engine")


class RequestOutputs:
    """Sampling, stop checks and outputs of `LLMEngine` (a mixin; see the module docstring)."""

    def _sample_isolated(
        self, sampling: list[ScheduledSeq], logits: torch.Tensor, failed: dict[str, str]
    ) -> list[Request]:
        """Sample and append one token per entry of ``sampling`` (``logits`` row order);
        return the requests that finished. A request whose rows or token handling raise is
        failed alone (recorded in ``failed``); the others go on."""
        seqs = [e.seq for e in sampling]
        bitmask = None  # [B, W] int32 when some row is constrained
        if self.structured.live:
            t0 = time.perf_counter()
            bitmask = self.structured.token_bitmask(seqs)
            self.metrics.stage_seconds["grammar_mask"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        # ~2 us per seeded row: lets a retry draw what the batched call would have drawn.
        rewind = [(s.generator, s.generator.get_state()) for s in seqs if s.generator is not None]
        try:
            rows = [self._sampling_row(s) for s in seqs]
            # The sampled tokens' log-probabilities only feed `cumulative_logprob`, reported
            # only to requests that ask for logprobs: without one, skip the logsumexp.
            want_lp = any(s.params.logprobs is not None for s in seqs)
            out = self.sampler(logits, rows, bitmask, sampled_logprobs=want_lp)
            picks: list[tuple[SamplerOutput, int] | None] = [(out, i) for i in range(len(seqs))]
        except Exception:
            logger.exception("sampling %d sequences failed; retrying request by request", len(seqs))
            for generator, state in rewind:
                generator.set_state(state)
            picks = self._sample_per_request(seqs, logits, bitmask, failed)
        self.metrics.stage_seconds["sampling"] += time.perf_counter() - t0
        finished: list[Request] = []
        for seq, pick in zip(seqs, picks, strict=True):
            request = seq.request
            if pick is None or request.request_id in failed:
                continue
            try:
                self._append_token(seq, *pick)
            except Exception as exc:
                self._fail_request(request, exc, failed)
                continue
            if seq.is_finished and request.is_finished:
                finished.append(request)
        return finished

    def _add_prompt_logprobs(
        self, prompt_rows: list[tuple[ScheduledSeq, torch.Tensor]], failed: dict[str, str]
    ) -> None:
        """Prompt log-probabilities of the positions this step computed (`execute`'s
        ``prompt_rows``); a request whose entries raise fails alone."""
        t0 = time.perf_counter()
        compute_logits = self.runner.model.compute_logits
        for entry, hidden in prompt_rows:
            request = entry.seq.request
            if request.request_id in failed:
                continue
            try:
                with torch.inference_mode():
                    add_prompt_logprobs(
                        entry.seq,
                        entry.prompt_logits,
                        hidden,
                        compute_logits,
                        self.tokenizer.decode,
                    )
            except Exception as exc:
                self._fail_request(request, exc, failed)
        self.metrics.stage_seconds["lm_head"] += time.perf_counter() - t0

    def _sample_per_request(
        self,
        seqs: list[SequenceCoroutine],
        logits: torch.Tensor,
        bitmask: torch.Tensor | None,
        failed: dict[str, str],
    ) -> list[tuple[SamplerOutput, int] | None]:
        """The sampler run once per request (its rows together); ``(output, row)`` per sequence,
        None for the sequences of requests that failed."""
        rows_of: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            rows_of.setdefault(seq.request.request_id, []).append(i)
        picks: list[tuple[SamplerOutput, int] | None] = [None] * len(seqs)
        for idx in rows_of.values():
            try:
                rows = [self._sampling_row(seqs[i]) for i in idx]
                out = self.sampler(logits[idx], rows, None if bitmask is None else bitmask[idx])
            except Exception as exc:
                self._fail_request(seqs[idx[0]].request, exc, failed)
                continue
            for row, i in enumerate(idx):
                picks[i] = (out, row)
        return picks

    def _fail_request(
        self,
        request: Request,
        exc: Exception | None,
        failed: dict[str, str],
        reason: str | None = None,
    ) -> None:
        """End every sample of ``request`` now; the step returns it with ``error`` set to
        ``reason`` (default: the exception, named)."""
        if request.request_id in failed:
            return
        if reason is None:
            logger.error("request %s failed in the engine", request.request_id, exc_info=exc)
            reason = f"the engine failed while processing this request ({_describe(exc)})"
        failed[request.request_id] = reason
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def _fail_step(self, scheduled: list[ScheduledSeq], exc: Exception) -> list[RequestOutput]:
        """The model forward raised: fail the requests of this step, keep the engine going."""
        logger.error("the model forward failed on %d sequences", len(scheduled), exc_info=exc)
        reason = (
            f"the model forward of this request's engine step failed ({_describe(exc)}); "
            "every request in that step failed with it"
        )
        failed: dict[str, str] = {}
        for entry in scheduled:
            self._fail_request(entry.seq.request, exc, failed, reason)
        self.scheduler.remove_finished()
        return self._finished_outputs([], failed)

    def _finished_outputs(
        self, finished: list[Request], failed: dict[str, str]
    ) -> list[RequestOutput]:
        """Outputs of the requests that finished and of those that ``failed``; both leave the
        request table."""
        results = []
        for request in finished:
            if request.request_id in failed:
                continue
            try:
                results.append(self._make_output(request))
            except Exception as exc:
                self._fail_request(request, exc, failed)
                continue
            del self.requests[request.request_id]
            self.structured.release(request.request_id)
        for request_id, reason in failed.items():
            request = self.requests.pop(request_id, None)
            self.structured.release(request_id)
            if request is not None:
                results.append(
                    RequestOutput(
                        request_id,
                        request.prompt,
                        request.prompt_token_ids,
                        [],
                        finished=True,
                        error=reason,
                    )
                )
        return results

    def _sampling_row(self, seq: SequenceCoroutine) -> SamplingRow:
        p = seq.request.params
        block: list[int] | tuple = ()  # read only while min_tokens holds: built only then
        if p.min_tokens:
            block = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
        prompt = seq.request.prompt_token_ids
        return SamplingRow(p, prompt, seq.output_token_ids, seq.generator, block)

    def _append_token(self, seq: SequenceCoroutine, out: SamplerOutput, row: int) -> None:
        token = out.sampled_token_ids[row]
        p = seq.params
        seq.output_token_ids.append(token)
        metrics = seq.request.metrics
        metrics.last_token_time = time.time()
        if metrics.first_token_time is None:
            metrics.first_token_time = metrics.last_token_time
        self.stats.num_generated_tokens += 1
        if out.sampled_logprobs is not None:
            seq.cumulative_logprob += out.sampled_logprobs[row]
        top = out.top_logprobs[row]
        if seq.logprobs is not None and top is not None:
            seq.logprobs.append(
                {t: Logprob(lp, rank, self.tokenizer.decode([t])) for t, lp, rank in top}
            )
        if seq.grammar is not None:
            t0 = time.perf_counter()
            seq.grammar.accept(token)  # raises (failing the request) on a forbidden token
            self.metrics.stage_seconds["grammar_mask"] += time.perf_counter() - t0
        n_out = seq.num_output_tokens
        can_stop = n_out >= p.min_tokens
        if can_stop and not p.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop", None)
            return
        if can_stop and token in p.stop_token_ids:
            self._finish(seq, "stop", token)
            return
        matched = seq.detokenizer.add_tokens([token])  # no stop-string match below min_tokens
        if matched is not None:
            self._finish(seq, "stop", matched)
            return
        if seq.grammar is not None and seq.grammar.is_stopped:
            # The grammar is complete and nothing may follow (a closed JSON value, a choice):
            # end now rather than spend a step on the one token left (EOS), min_tokens or not.
            self._finish(seq, "stop", None)
            return
        if (p.max_tokens is not None and n_out >= p.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            self._finish(seq, "length", None)

    def _finish(self, seq: SequenceCoroutine, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)

    def _make_output(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            want_lp = request.params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.finalize(),
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                    logprobs=seq.logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        metrics = request.metrics
        metrics.finished_time = time.time()
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            finished=True,
            metrics=metrics,
            prompt_logprobs=request.prompt_logprobs,
        )


def _describe(exc: Exception) -> str:
    """``"TypeName: message"``, the message cut to 200 characters."""
    text = str(exc)
    return f"{type(exc).__name__}: {text if len(text) <= 200 else text[:197] + '...'}"
