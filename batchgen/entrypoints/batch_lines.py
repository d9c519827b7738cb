"""Lines of an OpenAI Batch input file -> `BatchRequest` (`parse_batch_line`). Pure functions,
no I/O.

A line is either the envelope ``{"custom_id", "method": "POST", "url", "body"}`` or a plain
body such as ``{"prompt": "..."}`` (a completion; with ``"messages"`` a chat completion) whose
``custom_id`` defaults to ``line-<N>``; the body is checked by
`batchgen.entrypoints.request_body.parse_request_body`. `batch_line_custom_id` finds a line's
custom_id without checking the body; `BlankLines` counts the blank lines between requests.
Errors are `BatchLineError` (`batchgen.entrypoints.openai_errors`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from batchgen.entrypoints.custom_id_salvage import salvage_custom_id
from batchgen.entrypoints.openai_errors import (
    INVALID_JSON_LINE,
    INVALID_METHOD,
    INVALID_REQUEST,
    MISSING_REQUIRED_PARAMETER,
    BatchLineError,
    ProtocolError,
    describe_json,
    json_type,
)
from batchgen.entrypoints.request_body import (
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    ApiRequest,
    parse_request_body,
)

_ENVELOPE_KEYS = ("url", "method", "body")


@dataclass(frozen=True)
class BatchRequest:
    """One valid batch input line: its ``custom_id``, 1-based ``line`` number and request."""

    custom_id: str
    line: int
    request: ApiRequest


class BlankLines:
    """Counts the blank (empty or whitespace-only) lines inside a batch input file.

    Blank lines are skipped, but one between requests is worth telling the user about (a
    damaged or badly concatenated file). Blank lines after the last request line (a trailing
    newline, an empty final line) are normal and never counted: a blank line counts only once a
    request line follows it. Feed every line in order to `skip`.

    Attributes:
        count: blank lines seen before the last request line so far.
        lines: their 1-based line numbers, the first `MAX_LISTED` of them.
    """

    MAX_LISTED = 20

    def __init__(self) -> None:
        self.count = 0
        self.lines: list[int] = []
        self._pending_count = 0  # blank lines since the last request line
        self._pending: list[int] = []

    def skip(self, line: int, raw: str | bytes) -> bool:
        """True when ``raw`` (line number ``line``) is blank and must be skipped."""
        if raw.strip():
            room = self.MAX_LISTED - len(self.lines)
            self.lines.extend(self._pending[:room])
            self.count += self._pending_count
            self._pending_count = 0
            self._pending.clear()
            return False
        self._pending_count += 1
        if len(self._pending) < self.MAX_LISTED:
            self._pending.append(line)
        return True

    def describe(self) -> str:
        """E.g. ``"2 blank lines (lines 3, 7)"``; the list ends with ``...`` when cut."""
        more = ", ..." if self.count > len(self.lines) else ""
        listed = ", ".join(map(str, self.lines))
        noun = "line" if self.count == 1 else "lines"
        return f"{self.count} blank {noun} ({noun} {listed}{more})"


def _strict_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value")


def parse_batch_line(raw: str | bytes, line: int) -> BatchRequest:
    """Parse one line of an OpenAI Batch input file.

    Accepted forms: the envelope ``{"custom_id", "method": "POST", "url", "body"}`` (``method``
    may be omitted), or a plain body (no ``url``/``method``/``body`` key) such as
    ``{"prompt": "...", "max_tokens": 32}``, which is a completion, or a chat completion when it
    has ``"messages"``; its ``custom_id`` key is optional and defaults to ``line-<line>``.

    Args:
        raw: the line, as text or UTF-8 bytes, with or without its newline.
        line: its 1-based line number (used in messages and for default custom_ids).

    Raises:
        BatchLineError: invalid UTF-8 or JSON (including NaN/Infinity), not an object, missing
            or non-string custom_id, method other than POST, unknown url, or an invalid body
            (see `parse_request_body`).
    """
    obj = _decode_batch_line(raw, line)
    if any(key in obj for key in _ENVELOPE_KEYS):
        custom_id, url, body = _parse_envelope(obj, line)
    else:
        body = dict(obj)
        custom_id = _custom_id(body.pop("custom_id", f"line-{line}"), line)
        url = CHAT_COMPLETIONS_URL if "messages" in body else COMPLETIONS_URL
    try:
        return BatchRequest(custom_id, line, parse_request_body(url, body))
    except ProtocolError as err:
        raise BatchLineError(
            str(err), line=line, custom_id=custom_id, code=err.code, param=err.param
        ) from None


def batch_line_custom_id(raw: str | bytes, line: int) -> str | None:
    """The custom_id `parse_batch_line` gives a line (or its `BatchLineError` carries), found
    without checking the body, so about ten times faster; None for a line whose result a
    custom_id cannot name (invalid JSON naming no custom_id plainly, not an object, no usable
    custom_id)."""
    try:
        obj = _decode_batch_line(raw, line)
        if any(key in obj for key in _ENVELOPE_KEYS):
            return _custom_id(obj.get("custom_id"), line)
        return _custom_id(obj.get("custom_id", f"line-{line}"), line)
    except BatchLineError as err:
        return err.custom_id


def _decode_batch_line(raw: str | bytes, line: int) -> dict[str, Any]:
    """A batch line's JSON object (`parse_batch_line`'s first half)."""
    # A line that is not JSON keeps the custom_id its raw text plainly names, if any
    # (`salvage_custom_id`).
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        salvaged = salvage_custom_id(raw.decode("utf-8", "replace"))
        raise BatchLineError(
            "not valid UTF-8", line=line, custom_id=salvaged, code=INVALID_JSON_LINE
        ) from None
    # Without its newline, json's error position is a position in this line.
    text = text.lstrip("\ufeff").rstrip("\r\n")
    try:
        obj = json.loads(text, parse_constant=_strict_constant)
    except json.JSONDecodeError as err:
        # err.pos: 0-based character offset in the line (a column past the end: the line ended
        # too early). Some of json's messages end in "at" (they expect a position after them).
        msg = err.msg.removesuffix(" at")
        raise BatchLineError(
            f"not valid JSON at column {err.pos + 1} (in characters): {msg}",
            line=line,
            custom_id=salvage_custom_id(text),
            code=INVALID_JSON_LINE,
        ) from None
    except RecursionError:
        raise BatchLineError(
            "JSON nested too deeply", line=line, custom_id=None, code=INVALID_JSON_LINE
        ) from None
    except ValueError as err:
        # NaN / Infinity (`_strict_constant`), or an integer past Python's digit limit.
        detail = str(err)
        if "digits" in detail and "limit" in detail:
            detail = f"an integer has more than {sys.get_int_max_str_digits()} digits"
        raise BatchLineError(
            f"not valid JSON: {detail}",
            line=line,
            custom_id=salvage_custom_id(text),
            code=INVALID_JSON_LINE,
        ) from None
    if not isinstance(obj, dict):
        raise BatchLineError(
            f"a batch line must be a JSON object, got {json_type(obj)}",
            line=line,
            custom_id=None,
            code=INVALID_JSON_LINE,
        )
    return obj


def _custom_id(value: Any, line: int) -> str:
    if not isinstance(value, str) or not value:
        raise BatchLineError(
            f"'custom_id' must be a non-empty string, got {describe_json(value)}",
            line=line,
            custom_id=None,
            code=MISSING_REQUIRED_PARAMETER if value is None else INVALID_REQUEST,
            param="custom_id",
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800": not storable text
        raise BatchLineError(
            "'custom_id' must be valid Unicode text (it contains a lone surrogate escape)",
            line=line,
            custom_id=None,
            code=INVALID_REQUEST,
            param="custom_id",
        ) from None
    return value


def _parse_envelope(obj: dict[str, Any], line: int) -> tuple[str, str, Any]:
    if "custom_id" not in obj:
        raise BatchLineError(
            "missing 'custom_id'",
            line=line,
            custom_id=None,
            code=MISSING_REQUIRED_PARAMETER,
            param="custom_id",
        )
    custom_id = _custom_id(obj["custom_id"], line)
    unknown = sorted(set(obj) - {"custom_id", *_ENVELOPE_KEYS})
    if unknown:
        raise BatchLineError(
            f"unknown key '{unknown[0]}' in a batch line (keys: custom_id, method, url, body)",
            line=line,
            custom_id=custom_id,
            param=unknown[0],
        )
    method = obj.get("method", "POST")
    if method != "POST":
        raise BatchLineError(
            f"'method' must be \"POST\", got {describe_json(method)}",
            line=line,
            custom_id=custom_id,
            code=INVALID_METHOD,
            param="method",
        )
    if "url" not in obj or "body" not in obj:
        missing = "url" if "url" not in obj else "body"
        raise BatchLineError(
            f"missing '{missing}'",
            line=line,
            custom_id=custom_id,
            code=MISSING_REQUIRED_PARAMETER,
            param=missing,
        )
    return custom_id, obj["url"], obj["body"]


# ---------------------------------------------------------------------------------------------
