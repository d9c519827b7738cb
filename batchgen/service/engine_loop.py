"""The single engine thread: feeds one `LLMEngine` from every in-progress batch and from online
(``/v1/completions``, ``/v1/chat/completions``) requests, and commits each finished batch
request to the store in the step it finishes.

Only this thread touches the engine (it is not thread-safe). Other threads talk to it through
`EngineLoop.submit_online`, `abort_online`, `activate_batch` and `cancel_batch`, which put
commands on a thread-safe queue; answers go back through callbacks the caller supplies
(`OnlineRequest.emit`), which must themselves be thread-safe (the app wraps them in
``loop.call_soon_threadsafe``).

Input processing (parsing a stored batch line, the chat template, tokenization and the length
checks: `InputProcessor`) runs on two worker threads, one for online and one for batch requests,
never on the engine thread: a long prompt takes seconds to tokenize, and every other request
would wait that long for its next token. The engine thread hands a request to a worker when it
admits it (it counts against ``max_in_flight`` from then on) and queues the processed prompt
(`LLMEngine.add_processed_request`) in the first iteration after the worker is done.

Admission, once per loop iteration before ``engine.step()``:

1. online requests first (they are interactive; their number is bounded by the HTTP clients);
2. then batch requests, round-robin over the in-progress batches (oldest first, one request per
   batch per turn), until ``max_in_flight`` requests are in the engine. A small batch submitted
   behind a large one therefore gets every other free slot instead of waiting for the large
   one to drain.

Durability: the attempts of requests handed to the engine and the results of requests that
finished are committed in one transaction per iteration (`Store.commit_progress`). A request
killed in flight is still ``pending`` in the store and runs again after a restart; a finished
one never does (its ``attempts`` stays 1).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from batchgen.engine.input_processor import ProcessedPrompt
from batchgen.entrypoints.openai_protocol import (
    REQUEST_FAILED,
    ApiRequest,
    BatchLineError,
    BatchRequest,
    dumps_line,
    error_line,
    error_line_from,
    parse_batch_line,
    rejected_error,
    response_body,
    success_line,
)
from batchgen.outputs import RequestOutput
from batchgen.service import store as st
from batchgen.service.latency import LatencyHistograms

logger = logging.getLogger(__name__)

# Pending requests read from the store per batch at a time.
_FETCH_SIZE = 256
# Idle wait for a command when nothing runs (seconds); also the expiry check period.
_IDLE_WAIT_S = 0.5
# Window of the tokens/s gauge (seconds).
_RATE_WINDOW_S = 10.0
# How often the engine's own run metrics (tile density) are read (seconds).
_ENGINE_METRICS_PERIOD_S = 1.0


@dataclass
class StreamDelta:
    """New text of one streamed sample (``index``) since the previous delta."""

    index: int
    text: str


@dataclass
class OnlineEvent:
    """What the engine thread reports about an online request.

    ``kind`` is ``"admitted"`` (streaming requests only: the engine accepted the request),
    ``"delta"`` (``deltas`` set; streaming requests only), ``"done"`` (``output`` and ``body``
    set: the finished `RequestOutput` and its OpenAI response object) or ``"error"``
    (``status``, ``message``, ``code`` and maybe ``param`` set; the request is over).
    """

    kind: str
    deltas: list[StreamDelta] = field(default_factory=list)
    output: RequestOutput | None = None
    body: dict | None = None
    sent: dict[int, int] = field(default_factory=dict)
    status: int = 0
    message: str = ""
    code: str | None = None
    param: str | None = None


@dataclass
class OnlineRequest:
    """An online request. ``emit`` is called from the engine thread (must be thread-safe).

    With ``stream`` set, ``delta`` events carry text as it is generated (holding back the last
    ``len(longest stop string) - 1`` characters, which a later stop match could still cut);
    the ``done`` event's ``sent`` maps each sample index to the number of characters already
    sent, so the caller sends the rest of ``output.outputs[i].text``.
    """

    api: ApiRequest
    emit: Callable[[OnlineEvent], None]
    stream: bool = False
    request_id: str = field(default_factory=lambda: f"req_{uuid.uuid4().hex}")


@dataclass
class _InFlightBatchRequest:
    batch_id: str
    idx: int
    line: int
    custom_id: str
    api: ApiRequest


@dataclass
class _Preparing:
    """A request whose input a worker thread is processing; ``future`` gives what
    `EngineLoop._prepare` (online) or `EngineLoop._prepare_batch` returns."""

    future: Future
    online: OnlineRequest | None = None
    cursor: _BatchCursor | None = None
    pending: st.PendingRequest | None = None


@dataclass
class _BatchCursor:
    """An in-progress batch as the engine loop sees it."""

    batch_id: str
    expires_at: int | None
    remaining: int  # pending in the store and not yet handed to the engine
    after_idx: int = -1
    buffer: collections.deque = field(default_factory=collections.deque)
    exhausted: bool = False
    in_flight: int = 0

    @property
    def done(self) -> bool:
        return self.exhausted and not self.buffer and self.in_flight == 0


@dataclass
class LoopStats:
    """A snapshot of the loop for ``/metrics`` (read from other threads; replaced whole)."""

    batch_queued: int = 0
    batch_running: int = 0
    online_running: int = 0
    online_waiting: int = 0
    active_batches: int = 0
    active_coroutines: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    generated_tokens_per_s: float = 0.0
    tile_density: float | None = None
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prefix_cache_evictions_total: int = 0
    finished: dict[tuple[str, str], int] = field(default_factory=dict)


class EngineLoop:
    """Runs the engine on a background thread.

    Args:
        engine: an `LLMEngine` (used from the loop thread only once `start` was called).
        store: the job store.
        max_in_flight: most batch+online requests in the engine at once (online requests are
            admitted even above it).
        on_results: called (from the loop thread) with the ids of batches that got new stored
            results or changed status; must be thread-safe.
        finalize: called (from the loop thread) with ``(batch_id, final_status)`` once a batch
            has no request left to run or was cancelled / expired; it writes the files.
    """

    def __init__(
        self,
        engine: Any,
        store: st.Store,
        *,
        max_in_flight: int,
        on_results: Callable[[set[str]], None],
        finalize: Callable[[str, str], None],
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.engine = engine
        self.store = store
        self.max_in_flight = max_in_flight
        self._on_results = on_results
        self._finalize = finalize
        self._commands: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="batchgen-engine", daemon=True)
        self._stop = threading.Event()
        self._batches: dict[str, _BatchCursor] = {}  # insertion order = admission order
        self._rr: collections.deque[str] = collections.deque()
        self._batch_in_flight: dict[str, _InFlightBatchRequest] = {}
        self._online: dict[str, OnlineRequest] = {}
        self._sent: dict[str, dict[int, int]] = {}  # streamed chars per sample
        self._online_waiting: collections.deque[OnlineRequest] = collections.deque()
        self._preparing: dict[str, _Preparing] = {}  # insertion order = hand-over order
        # One worker per kind: an online request never waits behind a long batch prompt, and
        # each kind's requests reach the engine in admission order.
        self._online_worker = ThreadPoolExecutor(1, thread_name_prefix="batchgen-input-online")
        self._batch_worker = ThreadPoolExecutor(1, thread_name_prefix="batchgen-input-batch")
        self._started: list[tuple[str, int]] = []
        self._finished: list[st.FinishedRequest] = []
        self._changed: set[str] = set()
        self._counts: collections.Counter = collections.Counter()
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self._tile_density: float | None = None
        self._metrics_at = 0.0
        self.stats = LoopStats()
        self.latency = LatencyHistograms()  # observed here, read by /metrics
        self.fatal_error: str | None = None

    # ---- API for other threads ----------------------------------------------------------
    def start(self) -> None:
        """Start the thread; in-progress batches of the store are resumed."""
        for batch in self.store.batches_with_status(st.IN_PROGRESS):
            self.activate_batch(batch["id"])
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step. Requests in flight stay pending in the store."""
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)
        for worker in (self._online_worker, self._batch_worker):
            worker.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit_online(self, request: OnlineRequest) -> None:
        self._commands.put(("online", request))

    def abort_online(self, request_id: str) -> None:
        """Stop an online request (its client went away); no event follows."""
        self._commands.put(("abort", request_id))

    def activate_batch(self, batch_id: str) -> None:
        """Start running a batch that validation moved to ``in_progress``."""
        self._commands.put(("batch", batch_id))

    def cancel_batch(self, batch_id: str) -> None:
        """Abort a batch already moved to ``cancelling``; it is then finalized as cancelled."""
        self._commands.put(("cancel", batch_id))

    # ---- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._iterate()
        except Exception as exc:  # a bug in the loop itself: report it on /health
            logger.exception("the engine loop stopped")
            self.fatal_error = f"{type(exc).__name__}: {exc}"
            preparing = [p.online for p in self._preparing.values() if p.online is not None]
            for request in [*self._online.values(), *self._online_waiting, *preparing]:
                self._emit_error(request, 503, "the engine stopped", "engine_stopped")

    def _iterate(self) -> None:
        busy = self.engine.has_unfinished_requests() or self._has_admissible_work()
        self._drain_commands(block=not busy)  # a worker that finishes sends "wake"
        self._check_expiry()
        self._admit()
        self._take_prepared()
        outputs: list[RequestOutput] = []
        if self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step()
            except Exception as exc:
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all_in_flight(exc)
        for output in outputs:
            self._on_output(output)
        self._stream_deltas()
        self._commit()
        self._finish_done_batches()
        self._update_stats()

    def _has_admissible_work(self) -> bool:
        if self._online_waiting or any(p.future.done() for p in self._preparing.values()):
            return True
        return self._num_in_flight < self.max_in_flight and any(
            c.buffer or not c.exhausted for c in self._batches.values()
        )

    def _drain_commands(self, *, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else None
            while True:
                if command is not None:
                    self._handle(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "online":
            self._online_waiting.append(command[1])
        elif kind == "abort":
            self._abort_online(command[1])
        elif kind == "batch":
            self._add_batch(command[1])
        elif kind == "cancel":
            self._cancel(command[1])

    # ---- batches ------------------------------------------------------------------------
    def _add_batch(self, batch_id: str) -> None:
        if batch_id in self._batches:
            return
        batch = self.store.get_batch(batch_id)
        if batch is None:
            return
        if batch["status"] == st.CANCELLING:  # cancelled before we got to it
            self._finalize(batch_id, st.CANCELLED)
            return
        if batch["status"] != st.IN_PROGRESS:
            return
        remaining = self.store.count_pending(batch_id)
        self._batches[batch_id] = _BatchCursor(batch_id, batch["expires_at"], remaining)
        self._rr.append(batch_id)
        logger.info("batch %s: %d requests to run", batch_id, remaining)

    def _drop_batch(self, batch_id: str) -> None:
        """Forget a batch, aborting its requests in the engine (their results are dropped)."""
        self._batches.pop(batch_id, None)
        with contextlib.suppress(ValueError):
            self._rr.remove(batch_id)
        for request_id, req in list(self._batch_in_flight.items()):
            if req.batch_id == batch_id:
                del self._batch_in_flight[request_id]
                self.engine.abort_request(request_id)
        for request_id, prep in list(self._preparing.items()):
            if prep.pending is not None and prep.pending.batch_id == batch_id:
                del self._preparing[request_id]  # its result is dropped when it comes
                prep.future.cancel()

    def _cancel(self, batch_id: str) -> None:
        if batch_id not in self._batches:
            return  # not running (yet): `_add_batch` or validation finalizes it
        self._drop_batch(batch_id)
        self._commit()  # results that finished before the cancel are kept
        self._finalize(batch_id, st.CANCELLED)

    def _check_expiry(self) -> None:
        now = time.time()
        for cursor in list(self._batches.values()):
            if cursor.expires_at is not None and now >= cursor.expires_at:
                logger.info("batch %s expired", cursor.batch_id)
                self._drop_batch(cursor.batch_id)
                self._commit()
                self._finalize(cursor.batch_id, st.EXPIRED)

    def _finish_done_batches(self) -> None:
        for cursor in list(self._batches.values()):
            if cursor.done:
                self._batches.pop(cursor.batch_id)
                with contextlib.suppress(ValueError):
                    self._rr.remove(cursor.batch_id)
                if self.store.transition(cursor.batch_id, st.FINALIZING, expect=[st.IN_PROGRESS]):
                    self._changed.add(cursor.batch_id)
                    self._finalize(cursor.batch_id, st.COMPLETED)
                elif (self.store.get_batch(cursor.batch_id) or {}).get("status") == st.CANCELLING:
                    self._finalize(cursor.batch_id, st.CANCELLED)

    # ---- admission ----------------------------------------------------------------------
    @property
    def _num_in_flight(self) -> int:
        return len(self._batch_in_flight) + len(self._online) + len(self._preparing)

    def _admit(self) -> None:
        while self._online_waiting:
            self._admit_online(self._online_waiting.popleft())
        idle_turns = 0
        while self._rr and self._num_in_flight < self.max_in_flight and idle_turns < len(self._rr):
            batch_id = self._rr[0]
            self._rr.rotate(-1)
            cursor = self._batches[batch_id]
            pending = self._next_pending(cursor)
            if pending is None:
                idle_turns += 1
                continue
            idle_turns = 0
            self._admit_batch_request(cursor, pending)

    def _next_pending(self, cursor: _BatchCursor) -> st.PendingRequest | None:
        if not cursor.buffer and not cursor.exhausted:
            rows = self.store.pending_requests(cursor.batch_id, cursor.after_idx, _FETCH_SIZE)
            if rows:
                cursor.after_idx = rows[-1].idx
                cursor.buffer.extend(rows)
            else:
                cursor.exhausted = True
        return cursor.buffer.popleft() if cursor.buffer else None

    def _admit_batch_request(self, cursor: _BatchCursor, pending: st.PendingRequest) -> None:
        cursor.remaining = max(0, cursor.remaining - 1)
        cursor.in_flight += 1
        future = self._batch_worker.submit(self._prepare_batch, pending)
        self._hand_over(
            f"req_{uuid.uuid4().hex}", _Preparing(future, cursor=cursor, pending=pending)
        )

    def _admit_online(self, request: OnlineRequest) -> None:
        future = self._online_worker.submit(self._prepare, request.api)
        self._hand_over(request.request_id, _Preparing(future, online=request))

    def _hand_over(self, request_id: str, prep: _Preparing) -> None:
        self._preparing[request_id] = prep
        prep.future.add_done_callback(lambda _: self._commands.put(("wake",)))

    def _prepare(self, api: ApiRequest) -> ProcessedPrompt:
        """On a worker thread: chat template, tokenization, length checks (ValueError)."""
        processor = self.engine.input_processor
        prompt = processor.apply_chat_template(api.messages) if api.is_chat else api.prompt
        return processor.process(prompt, api.sampling_params, max_tokens_must_fit=True)

    def _prepare_batch(self, pending: st.PendingRequest) -> tuple[BatchRequest, ProcessedPrompt]:
        """On a worker thread: parse the stored line (`BatchLineError`), then `_prepare` it
        (its exceptions carry the parsed line in ``err.batch_request``)."""
        parsed = parse_batch_line(pending.input, pending.line)
        try:
            return parsed, self._prepare(parsed.request)
        except Exception as err:
            err.batch_request = parsed
            raise

    def _take_prepared(self) -> None:
        """Queue in the engine every request whose input processing has finished (in hand-over
        order), or record why it cannot run."""
        for request_id, prep in list(self._preparing.items()):
            if not prep.future.done():
                continue
            del self._preparing[request_id]
            if prep.online is not None:
                self._take_online(request_id, prep)
            else:
                self._take_batch(request_id, prep)

    def _take_online(self, request_id: str, prep: _Preparing) -> None:
        request = prep.online
        api = request.api
        exc = _exception(prep.future)
        if isinstance(exc, ValueError):
            code, param = rejected_error(api, exc)
            self._emit_error(request, 400, str(exc), code, param)
            return
        if exc is not None:  # a bug in input processing: this request fails, not the loop
            logger.error("input of online request %s failed", request_id, exc_info=exc)
            self._emit_error(request, 500, _input_failure(exc), REQUEST_FAILED)
            return
        processed = prep.future.result()
        self.engine.add_processed_request(request_id, processed, api.sampling_params)
        self._online[request_id] = request
        if request.stream:
            self._sent[request_id] = {}
            request.emit(OnlineEvent("admitted"))

    def _take_batch(self, request_id: str, prep: _Preparing) -> None:
        cursor, pending = prep.cursor, prep.pending
        exc = _exception(prep.future)
        if exc is not None:
            cursor.in_flight -= 1
            self._record_failure(pending.batch_id, pending.idx, _input_error_line(pending, exc))
            return
        parsed, processed = prep.future.result()
        api = parsed.request
        self.engine.add_processed_request(request_id, processed, api.sampling_params)
        self._started.append((pending.batch_id, pending.idx))
        self._batch_in_flight[request_id] = _InFlightBatchRequest(
            pending.batch_id, pending.idx, pending.line, parsed.custom_id, api
        )

    def _abort_online(self, request_id: str) -> None:
        for i, waiting in enumerate(self._online_waiting):
            if waiting.request_id == request_id:
                del self._online_waiting[i]
                return
        prep = self._preparing.pop(request_id, None)
        if prep is not None:
            prep.future.cancel()
            return
        if self._online.pop(request_id, None) is not None:
            self._sent.pop(request_id, None)
            self.engine.abort_request(request_id)

    # ---- outputs ------------------------------------------------------------------------
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


def _exception(future: Future) -> BaseException | None:
    """The exception a finished worker job raised, or None. Read with ``future.exception()``
    rather than by re-raising ``future.result()``: re-raised here, its traceback would take in
    the engine thread's frames, whose locals hold the future, a reference cycle that kept each
    failed request's prompt (megabytes for an oversized one) alive until a full GC."""
    return future.exception()


def _input_failure(exc: Exception) -> str:
    return f"the server failed while processing this request's input ({type(exc).__name__})"


def _input_error_line(pending: st.PendingRequest, exc: Exception) -> dict:
    """The error line of a batch request whose input processing raised ``exc``."""
    if isinstance(exc, BatchLineError):  # validated before; only if the protocol changed since
        return error_line_from(exc)
    parsed: BatchRequest | None = getattr(exc, "batch_request", None)
    custom_id = parsed.custom_id if parsed is not None else None
    if isinstance(exc, ValueError) and parsed is not None:  # the engine refused the prompt
        code, param = rejected_error(parsed.request, exc)
        message = f"line {pending.line}: {exc}"
        return error_line(custom_id, code, message, param=param, line=pending.line)
    logger.error("input of batch %s line %d failed", pending.batch_id, pending.line, exc_info=exc)
    message = f"line {pending.line}: {_input_failure(exc)}"
    return error_line(custom_id, REQUEST_FAILED, message, line=pending.line)


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
