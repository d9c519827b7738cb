"""The output side of the service's engine loop (a mixin of `EngineLoop`): a finished request
becomes a stored result line (batch) or a ``done`` / ``error`` event (online), streamed text
goes out as deltas, each iteration's results are committed in one transaction
(`Store.commit_progress`), and `LoopStats` is refreshed for ``/metrics``.

It uses `EngineLoop`'s ``engine``, ``store``, ``latency``, ``stats``, ``_online``,
``_batch_in_flight``, ``_batches``, ``_sent``, ``_started``, ``_finished``, ``_changed``,
``_counts``, ``_commands``, ``_on_results``, ``_rate``, ``_metrics_at`` and ``_tile_density``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from batchgen.entrypoints.openai_protocol import (
    REQUEST_FAILED,
    dumps_line,
    error_line,
    response_body,
    success_line,
)
from batchgen.outputs import RequestOutput
from batchgen.service import store as st
from batchgen.service.engine_loop_records import LoopStats, OnlineEvent, OnlineRequest, StreamDelta

# Window of the tokens/s gauge (seconds).
_RATE_WINDOW_S = 10.0
# How often the engine's own run metrics (tile density) are read (seconds).
_ENGINE_METRICS_PERIOD_S = 1.0


class LoopOutputs:
    """`EngineLoop`'s output methods (see the module docstring)."""

    def _on_output(self, output: RequestOutput) -> None:
        online = self._online.pop(output.request_id, None)
        if online is not None:
            self.latency.observe(output, "online")
            self._finish_online(online, output)
            return
        req = self._batch_in_flight.pop(output.request_id, None)
        if req is None:
            return  # aborted batch request that finished in the same step
        self.latency.observe(output, "batch")
        cursor = self._batches.get(req.batch_id)
        if cursor is not None:
            cursor.in_flight -= 1
        if output.error is not None:
            line = error_line(
                req.custom_id, REQUEST_FAILED, f"line {req.line}: {output.error}", line=req.line
            )
            self._record_failure(req.batch_id, req.idx, line)
            return
        body = response_body(
            req.api, output, model=self.engine.model_name, tokenizer=self.engine.tokenizer
        )
        result = dumps_line(success_line(req.custom_id, output.request_id, body))
        usage = body["usage"]
        self._finished.append(
            st.FinishedRequest(
                req.batch_id,
                req.idx,
                True,
                result,
                usage["prompt_tokens"],
                usage["completion_tokens"],
            )
        )
        self._counts["batch", "succeeded"] += 1

    def _record_failure(self, batch_id: str, idx: int, line: dict) -> None:
        self._finished.append(st.FinishedRequest(batch_id, idx, False, dumps_line(line)))
        self._counts["batch", "failed"] += 1

    def _finish_online(self, request: OnlineRequest, output: RequestOutput) -> None:
        sent = self._sent.pop(request.request_id, {})
        if output.error is not None:
            self._emit_error(request, 400, output.error, REQUEST_FAILED)
            return
        body = response_body(
            request.api, output, model=self.engine.model_name, tokenizer=self.engine.tokenizer
        )
        self._counts["online", "succeeded"] += 1
        request.emit(OnlineEvent("done", output=output, body=body, sent=sent))

    def _emit_error(
        self,
        request: OnlineRequest,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
    ) -> None:
        self._counts["online", "failed"] += 1
        event = OnlineEvent("error", status=status, message=message, code=code, param=param)
        with contextlib.suppress(Exception):  # the client may be gone
            request.emit(event)

    def _stream_deltas(self) -> None:
        for request_id, sent in self._sent.items():
            texts = _partial_texts(self.engine, request_id)
            if texts is None:
                continue  # the engine does not expose partial text: the rest comes at "done"
            stops = self._online[request_id].api.sampling_params.stop or []
            hold = max((len(s) for s in stops), default=1) - 1
            deltas = []
            for index, text in texts.items():
                safe = len(text) - hold
                start = sent.get(index, 0)
                if safe > start:
                    deltas.append(StreamDelta(index, text[start:safe]))
                    sent[index] = safe
            if deltas:
                self._online[request_id].emit(OnlineEvent("delta", deltas=deltas))

    def _fail_all_in_flight(self, exc: Exception) -> None:
        reason = f"the engine failed while running this request ({type(exc).__name__})"
        for req in list(self._batch_in_flight.values()):
            message = f"line {req.line}: {reason}"
            line = error_line(req.custom_id, REQUEST_FAILED, message, line=req.line)
            self._record_failure(req.batch_id, req.idx, line)
            cursor = self._batches.get(req.batch_id)
            if cursor is not None:
                cursor.in_flight -= 1
        for request in list(self._online.values()):
            self._emit_error(request, 500, reason, "engine_error")
        for request_id in [*self._batch_in_flight, *self._online]:
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
        self._batch_in_flight.clear()
        self._online.clear()
        self._sent.clear()

    def _commit(self) -> None:
        if not self._started and not self._finished:
            if self._changed:
                self._on_results(self._changed)
                self._changed = set()
            return
        self.store.commit_progress(self._started, self._finished)
        self._changed.update(f.batch_id for f in self._finished)
        self._started, self._finished = [], []
        self._on_results(self._changed)
        self._changed = set()

    def _update_stats(self) -> None:
        engine = self.engine
        stats = engine.stats
        now = time.monotonic()
        self._rate.append((now, stats.num_generated_tokens))
        while len(self._rate) > 2 and now - self._rate[0][0] > _RATE_WINDOW_S:
            self._rate.popleft()
        (t0, n0), (t1, n1) = self._rate[0], self._rate[-1]
        if now - self._metrics_at >= _ENGINE_METRICS_PERIOD_S:
            self._metrics_at = now
            self._tile_density = _tile_density(engine)
        scheduler = getattr(engine, "scheduler", None)
        running = getattr(scheduler, "running", None)
        self.stats = LoopStats(
            batch_queued=sum(c.remaining for c in self._batches.values()),
            batch_running=len(self._batch_in_flight),
            online_running=len(self._online),
            online_waiting=self._commands.qsize(),
            active_batches=len(self._batches),
            active_coroutines=len(running) if running is not None else len(self._online),
            kv_cache_usage=float(engine.kv_cache.usage),
            prompt_tokens_total=stats.num_prompt_tokens,
            generated_tokens_total=stats.num_generated_tokens,
            generated_tokens_per_s=(n1 - n0) / (t1 - t0) if t1 > t0 else 0.0,
            tile_density=self._tile_density,
            prefix_cache_queries_total=getattr(stats, "prefix_cache_queries", 0),
            prefix_cache_hits_total=getattr(stats, "prefix_cache_hits", 0),
            prefix_cache_evictions_total=getattr(stats, "prefix_cache_evictions", 0),
            finished=dict(self._counts),
        )


def _tile_density(engine: Any) -> float | None:
    """The engine's expert-GEMM tile density (`LLMEngine.get_metrics`; a data-parallel
    engine's `live_metrics`, which needs no round trip to its ranks), None when unknown."""
    get_metrics = getattr(engine, "live_metrics", None) or getattr(engine, "get_metrics", None)
    if get_metrics is None:
        return None
    value = get_metrics().get("tile_density")
    return None if value is None else float(value)


def _partial_texts(engine: Any, request_id: str) -> dict[int, str] | None:
    """Text generated so far by each sample of an unfinished request
    (`LLMEngine.get_partial_texts`), or None when the engine (e.g. a test fake) lacks it: the
    stream then carries the whole text in its last chunk."""
    getter = getattr(engine, "get_partial_texts", None)
    return getter(request_id) if getter is not None else None
