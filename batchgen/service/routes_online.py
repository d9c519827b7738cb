"""``POST /v1/completions`` and ``/v1/chat/completions`` on the shared engine: a JSON response,
or with ``stream: true`` server-sent events (text streamed as the engine generates it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchgen.entrypoints.openai_protocol import (
    UNSUPPORTED_PARAMETER,
    ProtocolError,
    parse_request_body,
)
from batchgen.service.engine_loop import OnlineEvent, OnlineRequest
from batchgen.service.errors import APIError
from batchgen.service.params import json_object
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
    body = await json_object(request)
    stream = body.pop("stream", False)
    options = body.pop("stream_options", None)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", param="stream")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    try:
        api = parse_request_body(url, body)
    except ProtocolError as err:
        raise APIError(400, str(err), param=err.param, code=err.code) from None
    if stream and api.sampling_params.logprobs is not None:
        raise APIError(
            400,
            "'logprobs' cannot be combined with 'stream' in BatchGen",
            param="logprobs",
            code=UNSUPPORTED_PARAMETER,
        )
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
