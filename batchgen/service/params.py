"""Request parsing shared by the routes: JSON bodies, query integers, completion windows,
metadata. Each raises `APIError` (400) with a message naming the parameter."""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request

from batchgen.service.bodies import parse_json_object
from batchgen.service.errors import APIError

_WINDOW_RE = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_WINDOW_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MAX_WINDOW_S = 365 * 86400


async def json_object(request: Request, *, max_bytes: int) -> dict[str, Any]:
    """The JSON object body of a route whose bodies are small (parsed on the event loop; see
    `parse_json_object` for what is refused). Raises `APIError` 413 above ``max_bytes``."""
    raw = await request.body()
    if len(raw) > max_bytes:
        raise APIError(
            413,
            f"request body too large: {request.method} {request.url.path} takes at most "
            f"{max_bytes} bytes",
            code="request_too_large",
        )
    return parse_json_object(raw)


def parse_window(value: Any) -> int:
    """Seconds of a completion window such as ``"24h"`` (OpenAI's only value); BatchGen also
    takes ``<N>s``, ``<N>m``, ``<N>h``, ``<N>d`` up to 365 days."""
    match = _WINDOW_RE.match(value) if isinstance(value, str) else None
    seconds = int(match[1]) * _WINDOW_UNIT_S[match[2]] if match else 0
    if not match or seconds > _MAX_WINDOW_S:
        raise APIError(
            400,
            f"'completion_window' must be \"24h\" (or <N>s/m/h/d up to 365d), got {value!r}",
            param="completion_window",
            code="invalid_completion_window",
        )
    return seconds


def parse_metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    ok = (
        isinstance(value, dict)
        and len(value) <= 16
        and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in value.items()
        )
    )
    if not ok:
        raise APIError(
            400,
            "'metadata' must be an object of at most 16 string pairs "
            "(keys up to 64 characters, values up to 512)",
            param="metadata",
            code="invalid_metadata",
        )
    return value


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise APIError(
            400,
            f"'{name}' must be an integer in [{low}, {high}], got {raw!r}",
            param=name,
            code=f"invalid_{name}",
        )
    return value
