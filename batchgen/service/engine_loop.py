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

Modules: the loop's records (`OnlineRequest`, `OnlineEvent`, `LoopStats`, ...) are in
`batchgen.service.engine_loop_records` (re-exported here); the hand-over to the input workers
is the `LoopInputs` mixin in `batchgen.service.engine_loop_inputs`; the output side (results,
streaming, the per-iteration commit, the stats) is the `LoopOutputs` mixin in
`batchgen.service.engine_loop_outputs`. This module keeps `EngineLoop` itself: its API for
other threads, the loop, the batches and admission.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchgen.outputs import RequestOutput
from batchgen.service import store as st
from batchgen.service.engine_loop_inputs import LoopInputs
from batchgen.service.engine_loop_outputs import LoopOutputs
from batchgen.service.engine_loop_records import (  # noqa: F401 (re-exported)
    BatchCursor,
    InFlightBatchRequest,
    LoopStats,
    OnlineEvent,
    OnlineRequest,
    PreparingRequest,
    StreamDelta,
)
from batchgen.service.latency import LatencyHistograms

logger = logging.getLogger(__name__)

# Pending requests read from the store per batch at a time.
_FETCH_SIZE = 256
# Idle wait for a command when nothing runs (seconds); also the expiry check period.
_IDLE_WAIT_S = 0.5


class EngineLoop(LoopInputs, LoopOutputs):
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
        self._batches: dict[str, BatchCursor] = {}  # insertion order = admission order
        self._rr: collections.deque[str] = collections.deque()
        self._batch_in_flight: dict[str, InFlightBatchRequest] = {}
        self._online: dict[str, OnlineRequest] = {}
        self._sent: dict[str, dict[int, int]] = {}  # streamed chars per sample
        self._online_waiting: collections.deque[OnlineRequest] = collections.deque()
        self._preparing: dict[str, PreparingRequest] = {}  # insertion order = hand-over order
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
        self._batches[batch_id] = BatchCursor(batch_id, batch["expires_at"], remaining)
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

    def _next_pending(self, cursor: BatchCursor) -> st.PendingRequest | None:
        if not cursor.buffer and not cursor.exhausted:
            rows = self.store.pending_requests(cursor.batch_id, cursor.after_idx, _FETCH_SIZE)
            if rows:
                cursor.after_idx = rows[-1].idx
                cursor.buffer.extend(rows)
            else:
                cursor.exhausted = True
        return cursor.buffer.popleft() if cursor.buffer else None

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
