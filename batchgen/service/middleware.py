"""`GuardMiddleware`: the API key check and the request body limit, as raw ASGI middleware (so
that they act before any route reads the body)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchgen.service.errors import APIError, error_response

# Routes open without the API key (liveness and Prometheus scraping); everything else needs it,
# /openapi.json included (the interactive /docs pages are off).
OPEN_PATHS = frozenset({"/health", "/metrics"})


class GuardMiddleware:
    """API key check on every route but `OPEN_PATHS`, and a body size limit, before any route
    reads a byte.

    A declared ``Content-Length`` over the limit is refused at once; a body without one is
    counted as it streams and refused (413) once it passes the limit.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and path not in OPEN_PATHS:
            err = self._auth_error(headers.get("authorization"))
            if err is not None:
                await error_response(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _auth_error(self, header: str | None) -> APIError | None:
        if not header:
            return APIError(
                401,
                "missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        scheme, _, key = header.partition(" ")
        expected = self.api_key.encode("utf-8")  # type: ignore[union-attr]
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            key.strip().encode("utf-8"), expected
        ):
            return APIError(401, "invalid API key", code="invalid_api_key")
        return None

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body too large: the limit is {self.max_body_bytes} bytes",
            code="request_too_large",
        )

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise self._too_large()
            return message

        return counted
