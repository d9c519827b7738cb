"""The records of the service's engine loop: what other threads hand it (`OnlineRequest`), what
it reports back (`OnlineEvent`, `StreamDelta`, `LoopStats` for ``/metrics``) and its own
bookkeeping of requests (`InFlightBatchRequest`, `PreparingRequest`) and batches
(`BatchCursor`).

Plain data; `batchgen.service.engine_loop` re-exports the public ones.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from batchgen.entrypoints.openai_protocol import ApiRequest
from batchgen.outputs import RequestOutput
from batchgen.service import store as st


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
class InFlightBatchRequest:
    """A batch request the engine runs: where its result goes and the request it parsed to."""

    batch_id: str
    idx: int
    line: int
    custom_id: str
    api: ApiRequest


@dataclass
class PreparingRequest:
    """A request whose input a worker thread is processing; ``future`` gives what
    `EngineLoop._prepare` (online) or `EngineLoop._prepare_batch` returns."""

    future: Future
    online: OnlineRequest | None = None
    cursor: BatchCursor | None = None
    pending: st.PendingRequest | None = None


@dataclass
class BatchCursor:
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
