"""``/v1/batches``: create, list, get, cancel, and the ``results`` extension (stored results
after a cursor, with long polling) that `BatchGenClient.iter_results` reads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from batchgen.config_fields import close_name
from batchgen.entrypoints.openai_errors import UNSUPPORTED_PARAMETER
from batchgen.entrypoints.openai_protocol import SUPPORTED_URLS
from batchgen.service import store as st
from batchgen.service.errors import APIError, missing_parameter, not_found
from batchgen.service.objects import batch_object, list_object
from batchgen.service.params import json_object, parse_metadata, parse_window, query_int
from batchgen.service.runtime import Service

_MAX_RESULTS_WAIT_S = 30
# A batch creation body is a file id, an endpoint, a window and <= 16 short metadata pairs.
_MAX_CREATE_BODY_BYTES = 1 << 20


# The fields of a batch creation body: the required ones, each with what it takes.
_REQUIRED = {
    "input_file_id": 'the id of a file uploaded with purpose "batch"',
    "endpoint": f"one of {list(SUPPORTED_URLS)}",
    "completion_window": '"24h"',
}
_FIELDS = (*_REQUIRED, "metadata")


def check_batch_fields(body: dict) -> None:
    """Raises `APIError` 400 for an unknown field of a batch creation body (code
    ``unsupported_parameter``, with the field it is closest to) or a missing required one
    (``missing_required_parameter``), as batch lines are answered."""
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        close = close_name(unknown[0], _FIELDS)
        hint = f"; did you mean '{close}'?" if close else f"; the fields are {list(_FIELDS)}"
        raise APIError(
            400,
            f"unknown field '{unknown[0]}'{hint}",
            param=unknown[0],
            code=UNSUPPORTED_PARAMETER,
        )
    for name, what in _REQUIRED.items():
        if body.get(name) is None:
            raise missing_parameter(name, what)


def add_batch_routes(app: FastAPI, svc: Service) -> None:
    store = svc.store

    def _batch(batch_id: str) -> dict:
        row = store.get_batch(batch_id)
        if row is None:
            raise not_found("Batch", batch_id)
        return row

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        body = await json_object(request, max_bytes=_MAX_CREATE_BODY_BYTES)
        check_batch_fields(body)
        file_id, endpoint = body["input_file_id"], body["endpoint"]
        if not isinstance(file_id, str) or not file_id:
            raise APIError(
                400,
                f"'input_file_id' must be a file id (a string), got {json.dumps(file_id)}",
                param="input_file_id",
                code="invalid_input_file_id",
            )
        if endpoint not in SUPPORTED_URLS:
            raise APIError(
                400,
                f"'endpoint' must be one of {list(SUPPORTED_URLS)}, got {endpoint!r}",
                param="endpoint",
                code="invalid_endpoint",
            )
        window_s = parse_window(body.get("completion_window"))
        metadata = parse_metadata(body.get("metadata"))
        file_row = await run_in_threadpool(store.get_file, file_id)
        if file_row is None:
            raise not_found("File", file_id, param="input_file_id")
        if file_row["purpose"] != "batch":
            raise APIError(
                400,
                f"file {file_id!r} has purpose {file_row['purpose']!r}; a batch input needs "
                'purpose "batch"',
                param="input_file_id",
                code="invalid_input_file_id",
            )
        row = await run_in_threadpool(
            lambda: store.create_batch(
                input_file_id=file_id,
                endpoint=endpoint,
                completion_window=body["completion_window"],
                metadata=metadata,
                window_s=window_s,
            )
        )
        svc.jobs.validate(row["id"])
        return JSONResponse(batch_object(row, svc.model))

    @app.get("/v1/batches")
    def list_batches(request: Request) -> dict:
        limit = query_int(request, "limit", 20, 1, 100)
        rows, more = store.list_batches(after=request.query_params.get("after"), limit=limit)
        return list_object([batch_object(r, svc.model) for r in rows], more)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str) -> dict:
        return batch_object(_batch(batch_id), svc.model)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict:
        row = _batch(batch_id)
        if store.transition(batch_id, st.CANCELLING, expect=[st.VALIDATING, st.IN_PROGRESS]):
            svc.loop.cancel_batch(batch_id)
            row = _batch(batch_id)
        elif row["status"] not in (st.CANCELLING, st.CANCELLED):
            raise APIError(
                409,
                f"batch {batch_id!r} is {row['status']}; only validating or in_progress "
                "batches can be cancelled",
                code="batch_not_cancellable",
            )
        return batch_object(row, svc.model)

    @app.get("/v1/batches/{batch_id}/results")
    async def batch_results(request: Request, batch_id: str) -> dict:
        after = query_int(request, "after", 0, 0, 2**62)
        limit = query_int(request, "limit", 1000, 1, 10000)
        wait = query_int(request, "wait", 0, 0, int(_MAX_RESULTS_WAIT_S))
        deadline = time.monotonic() + wait
        while True:
            with svc.notifier.watch(batch_id) as event:
                row = await run_in_threadpool(store.get_batch, batch_id)
                if row is None:
                    raise not_found("Batch", batch_id)
                results = await run_in_threadpool(store.results_after, batch_id, after, limit)
                final = row["status"] in st.TERMINAL_STATUSES
                remaining = deadline - time.monotonic()
                if results or final or remaining <= 0:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        return {
            "object": "list",
            "data": [
                {
                    "seq": r.done_seq,
                    "index": r.idx,
                    "line": r.line,
                    "custom_id": r.custom_id,
                    "result": json.loads(r.result),
                }
                for r in results
            ],
            "last_seq": results[-1].done_seq if results else after,
            "has_more": len(results) == limit,
            "batch_status": row["status"],
            "complete": final and len(results) < limit,
        }
