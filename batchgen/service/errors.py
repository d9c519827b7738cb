"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}``.

Every error the service returns has this shape; routes raise `APIError` and the handlers in
`install_error_handlers` turn it (and FastAPI's / Starlette's own errors, and anything
unexpected) into a JSON response. Clients never see a stack trace: an unexpected exception is
logged here and answered with a fixed 500 message.

Every 400 of the Files and Batches routes carries a ``code``, as batch lines do: a required
parameter the request lacks is ``missing_required_parameter`` (`missing_parameter`), an unknown
one ``unsupported_parameter``, a bad value ``invalid_<param>`` (``invalid_endpoint``,
``invalid_input_file_id``, ``invalid_purpose``...), a body that cannot be read ``invalid_json``
or ``invalid_request``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchgen.entrypoints.openai_errors import MISSING_REQUIRED_PARAMETER

logger = logging.getLogger(__name__)

INVALID_REQUEST_ERROR = "invalid_request_error"
AUTHENTICATION_ERROR = "authentication_error"
SERVER_ERROR = "server_error"

# The OpenAI error ``type`` of each status we answer with.
_TYPES = {401: AUTHENTICATION_ERROR, 500: SERVER_ERROR, 503: SERVER_ERROR}


class APIError(Exception):
    """An error answered to the client.

    Attributes:
        status_code: HTTP status (400, 401, 404, 409, 413, 422, 503...).
        message: human-readable message, safe to show (no paths, no traces).
        type: OpenAI error type; derived from the status when not given.
        param: the offending request field, or None.
        code: a short machine-readable code (e.g. ``"invalid_request"``), or None.
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, INVALID_REQUEST_ERROR)


class SafeJSONResponse(JSONResponse):
    """A JSON response that always renders: text holding a lone surrogate (which UTF-8 cannot
    encode; JSON's ``"\\ud800"`` escape decodes to one) is written with ``\\u`` escapes
    instead of failing the response with a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The JSON body ``{"error": {...}}`` of an error response."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON response for ``err`` (status ``err.status_code``)."""
    body = error_body(err.message, type=err.type, param=err.param, code=err.code)
    return SafeJSONResponse(body, status_code=err.status_code, headers=headers)


def not_found(kind: str, object_id: str, param: str = "id") -> APIError:
    """404 for an unknown id; the message repeats the id but nothing of the server's state."""
    shown = object_id if len(object_id) <= 80 else object_id[:77] + "..."
    return APIError(404, f"No such {kind} object: {shown!r}", param=param, code="not_found")


def missing_parameter(name: str, what: str) -> APIError:
    """400 for a required parameter the request lacks (code ``missing_required_parameter``, as
    batch lines are answered); ``what`` says what it takes."""
    return APIError(
        400,
        f"missing required parameter '{name}' ({what})",
        param=name,
        code=MISSING_REQUIRED_PARAMETER,
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    where = f"'{param}': " if param else ""
    return f"{where}{first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Make every error response of ``app`` an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return error_response(exc, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"unknown route {request.method} {request.url.path}"
            code = "unknown_url"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return error_response(APIError(exc.status_code, message, code=code), exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        # Starlette re-raises the exception after this response and the server then drops the
        # connection: say so, so that clients open a new one instead of failing the next call.
        return error_response(
            APIError(500, "internal server error (logged on the server)", code="internal_error"),
            {"Connection": "close"},
        )
