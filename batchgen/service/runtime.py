"""What the routes share: `ServiceConfig`, and `Service`, which owns the store, the engine loop,
the job worker, the long-poll notifier and the metrics registry, and starts and stops them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.service import metrics
from batchgen.service import store as st
from batchgen.service.bodies import OnlineBodyParser, PromptLimits
from batchgen.service.engine_loop import EngineLoop
from batchgen.service.errors import APIError
from batchgen.service.jobs import JobWorker

DEFAULT_MAX_UPLOAD_BYTES = 200_000_000


@dataclass(frozen=True)
class ServiceConfig:
    """Service settings.

    Attributes:
        state_dir: where the job store lives (created when missing).
        api_key: required as ``Authorization: Bearer <key>`` on ``/v1`` routes; None: open.
        max_upload_bytes: largest request body accepted (file uploads, JSON bodies), bytes.
        max_in_flight: most requests in the engine at once; None: the engine's
            running-sequence limit (``EngineConfig.max_running_seqs``: ``max_num_seqs``, alias
            ``max_active_coroutines``; 1024 with coalesce, 256 with lockstep by default), so
            that admitted requests run at once and the
            engine keeps no long queue of its own in front of a newly arrived batch.
    """

    state_dir: Path
    api_key: str | None = None
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_in_flight: int | None = None


class ResultNotifier:
    """Wakes long polls of ``/v1/batches/{id}/results`` when a batch gets results.

    Lives on the event loop; `notify` must be called there (threads use
    ``loop.call_soon_threadsafe``). Enter `watch` *before* reading the store and wait on the
    event it yields, so that a notification in between is not missed. Events exist only
    while someone waits on them.
    """

    def __init__(self) -> None:
        self._events: dict[str, tuple[asyncio.Event, int]] = {}

    @contextlib.contextmanager
    def watch(self, batch_id: str) -> Iterator[asyncio.Event]:
        event, waiters = self._events.get(batch_id, (asyncio.Event(), 0))
        self._events[batch_id] = (event, waiters + 1)
        try:
            yield event
        finally:
            current = self._events.get(batch_id)
            if current is not None and current[0] is event:
                if current[1] <= 1:
                    del self._events[batch_id]
                else:
                    self._events[batch_id] = (event, current[1] - 1)

    def notify(self, batch_ids: set[str]) -> None:
        for batch_id in batch_ids:
            entry = self._events.pop(batch_id, None)
            if entry is not None:
                entry[0].set()


class Service:
    """What the routes share: store, engine loop, job worker, notifier."""

    def __init__(self, engine: Any, config: ServiceConfig) -> None:
        self.engine = engine
        self.model = engine.model_name
        self.config = config
        self.store = st.Store(config.state_dir)
        self.notifier = ResultNotifier()
        self.bodies = OnlineBodyParser(_prompt_limits(engine))
        self.aloop: asyncio.AbstractEventLoop | None = None
        max_in_flight = config.max_in_flight or _running_seqs(engine.config)
        self.jobs = JobWorker(self.store, on_ready=self._on_ready, on_change=self._notify)
        self.loop = EngineLoop(
            engine,
            self.store,
            max_in_flight=max_in_flight,
            on_results=self._notify,
            finalize=self.jobs.finalize,
        )
        self.registry = metrics.make_registry(
            metrics.ServiceCollector(
                lambda: self.loop.stats,
                self.store.count_batches_by_status,
                lambda: self.loop.is_alive,
                self.loop.latency,
            )
        )

    def _on_ready(self, batch_id: str) -> None:
        self.loop.activate_batch(batch_id)
        self._notify({batch_id})

    def _notify(self, batch_ids: set[str]) -> None:
        if self.aloop is not None and batch_ids:
            with contextlib.suppress(RuntimeError):  # the event loop is closing
                self.aloop.call_soon_threadsafe(self.notifier.notify, set(batch_ids))

    def start(self) -> None:
        self.aloop = asyncio.get_running_loop()
        self.jobs.recover()
        self.loop.start()
        self.jobs.start()

    def stop(self) -> None:
        self.loop.stop()
        self.jobs.stop()
        self.store.close()

    def engine_up(self) -> None:
        if not self.loop.is_alive:
            raise APIError(503, "the engine is not running", code="engine_stopped")


def _running_seqs(config: Any) -> int:
    """The engine's limit on sequences running at once."""
    limit = getattr(config, "max_running_seqs", None)
    return int(limit) if limit else int(config.max_num_seqs)


def _prompt_limits(engine: Any) -> PromptLimits | None:
    """The engine's prompt limits, for refusing an oversized prompt while parsing its body."""
    processor = getattr(engine, "input_processor", None)
    if processor is None:
        return None
    return PromptLimits(processor.max_model_len, processor.prompt_bound)
