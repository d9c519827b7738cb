"""The FastAPI app of ``batchgen serve``: OpenAI Files and Batches API, online completions,
models, health and metrics, over one background engine.

Routes (OpenAI's shapes and status codes; every route but ``/health`` and ``/metrics``, the
OpenAPI schema ``/openapi.json`` included, requires ``Authorization: Bearer KEY`` when the
server has an API key; the interactive ``/docs`` pages are off):

* ``POST /v1/files`` (multipart ``file`` + ``purpose=batch``), ``GET /v1/files``,
  ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``
* ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``),
  ``GET /v1/batches`` (``after``, ``limit``), ``GET /v1/batches/{id}``,
  ``POST /v1/batches/{id}/cancel``
* ``GET /v1/batches/{id}/results`` (BatchGen extension, used by `BatchGenClient`): results in
  the order they were stored, after a cursor, with long polling
* ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends SSE)
* ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``

Errors are OpenAI error objects (`batchgen.service.errors`); request bodies over the upload
limit get 413 before they are read whole.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from batchgen.service import metrics
from batchgen.service.errors import install_error_handlers, not_found
from batchgen.service.middleware import GuardMiddleware
from batchgen.service.routes_batches import add_batch_routes
from batchgen.service.routes_files import add_file_routes
from batchgen.service.routes_online import add_online_routes
from batchgen.service.runtime import Service, ServiceConfig

logger = logging.getLogger(__name__)

# Multipart framing allowed on top of the file itself (bytes).
_MULTIPART_SLACK = 64 * 1024

__all__ = ["ServiceConfig", "create_app"]


def create_app(engine: Any, config: ServiceConfig) -> FastAPI:
    """The ASGI app over ``engine`` (an `LLMEngine`; from now on used by the engine thread
    only). The store is opened here; the engine thread starts with the app's lifespan.

    Raises:
        OSError / sqlite3.DatabaseError: the state directory cannot be used.
    """
    svc = Service(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        svc.start()
        logger.info("serving %s; state in %s", svc.model, config.state_dir)
        try:
            yield
        finally:
            svc.stop()

    app = FastAPI(title="BatchGen", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = svc
    install_error_handlers(app)
    app.add_middleware(
        GuardMiddleware,
        api_key=config.api_key,
        max_body_bytes=config.max_upload_bytes + _MULTIPART_SLACK,
    )
    add_file_routes(app, svc)
    add_batch_routes(app, svc)
    add_online_routes(app, svc)
    _add_misc_routes(app, svc)
    return app


def _add_misc_routes(app: FastAPI, svc: Service) -> None:
    def model_object() -> dict[str, Any]:
        return {"id": svc.model, "object": "model", "created": 0, "owned_by": "batchgen"}

    @app.get("/v1/models")
    def list_models() -> dict:
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    def get_model(model_id: str) -> dict:
        if model_id != svc.model:
            raise not_found("Model", model_id)
        return model_object()

    @app.get("/health")
    def health() -> JSONResponse:
        if not svc.loop.is_alive:
            detail = svc.loop.fatal_error or "the engine thread is not running"
            return JSONResponse({"status": "error", "detail": detail}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(metrics.render(svc.registry), media_type=metrics.CONTENT_TYPE)
