"""``POST /v1/completions`` and ``/v1/chat/completions`` on the shared engine: a JSON response,
or with ``stream: true`` server-sent events (text streamed as the engine generates it). Bodies
are parsed by `batchgen.service.bodies` (large ones in a child process)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchgen.service.engine_loop import OnlineEvent, OnlineRequest
from batchgen.service.errors import APIError
from batchgen.service.runtime import Service
from batchgen.service.streaming import StreamFormatter


def add_online_routes(app: FastAPI, svc: Service) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _online(svc, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _online(svc, request, "/v1/chat/completions")


async def _online(svc: Service, request: Request, url: str) -> Response:
    """Run one online request on the engine; JSON or an SSE stream."""
    parsed = await svc.bodies.parse(await request.body(), url)
    api, stream, include_usage = parsed.api, parsed.stream, parsed.include_usage
    svc.engine_up()
    aloop = asyncio.get_running_loop()
    events: asyncio.Queue[OnlineEvent] = asyncio.Queue()

    def emit(event: OnlineEvent) -> None:
        with contextlib.suppress(RuntimeError):  # event loop closed
            aloop.call_soon_threadsafe(events.put_nowait, event)

    online = OnlineRequest(api, emit, stream=stream)
    svc.loop.submit_online(online)
    try:
        first = await events.get()
    except asyncio.CancelledError:
        svc.loop.abort_online(online.request_id)
        raise
    if first.kind == "error":
        raise APIError(first.status, first.message, param=first.param, code=first.code)
    if not stream:
        return JSONResponse(first.body)
    formatter = StreamFormatter(is_chat=api.is_chat, model=svc.model, include_usage=include_usage)

    async def chunks() -> AsyncIterator[bytes]:
        finished = False
        try:
            while True:
                event = await events.get()
                if event.kind == "delta":
                    for delta in event.deltas:
                        yield formatter.delta(delta.index, delta.text)
                elif event.kind == "done":
                    finished = True
                    yield formatter.finish(event.output, event.sent)  # type: ignore[arg-type]
                    return
                elif event.kind == "error":
                    finished = True
                    yield formatter.error(event.status, event.message, event.code)
                    return
        finally:
            if not finished:  # the client went away
                svc.loop.abort_online(online.request_id)

    return StreamingResponse(
        chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
