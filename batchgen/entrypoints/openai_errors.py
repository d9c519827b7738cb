"""Errors of the OpenAI protocol layer and the JSON type checks that raise them.

* Error codes (OpenAI's where one exists), `ProtocolError` (a ValueError with ``code`` and
  ``param``) and `BatchLineError` (adds the batch line's ``custom_id`` and number).
* JSON type checks: `checked_field` reads a body field and checks its JSON kind; `type_error`,
  `describe_json` and `json_type` word the message the way every check does.
* `rejected_error`: the ``(code, param)`` of a request the engine refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.entrypoints.request_body import ApiRequest

# Error codes (OpenAI's where one exists).
INVALID_JSON_LINE = "invalid_json_line"
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
INVALID_REQUEST = "invalid_request"
UNSUPPORTED_PARAMETER = "unsupported_parameter"
INVALID_URL = "invalid_url"
INVALID_METHOD = "invalid_method"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
INVALID_PROMPT = "invalid_prompt"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
REQUEST_FAILED = "request_failed"


class ProtocolError(ValueError):
    """An invalid request; ``str(err)`` is a message for the user.

    Attributes:
        code: OpenAI-style error code, e.g. ``"invalid_request"``.
        param: the offending field (dotted for nested ones, e.g. ``"messages[1].role"``) or
            None.
    """

    def __init__(self, message: str, *, code: str = INVALID_REQUEST, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


class BatchLineError(ProtocolError):
    """An invalid batch input line. The message starts with ``line <N>:``.

    Attributes:
        custom_id: the line's custom_id when it has a valid one (plain lines: ``line-<N>``;
            a line that is not valid JSON: the one its raw text plainly names, see
            `salvage_custom_id`), else None.
        line: 1-based line number in the input file.
    """

    def __init__(
        self,
        message: str,
        *,
        line: int,
        custom_id: str | None,
        code: str = INVALID_REQUEST,
        param: str | None = None,
    ):
        super().__init__(f"line {line}: {message}", code=code, param=param)
        self.line = line
        self.custom_id = custom_id


# ---------------------------------------------------------------------------------------------
# JSON type checks


def json_type(value: Any) -> str:
    """The JSON kind of a decoded value: ``null``, ``boolean``, ``integer``, ``number``, ``string``,
    ``array`` or ``object``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def describe_json(value: Any) -> str:
    """A value as an error message shows it: its JSON text, cut to 40 characters, and its kind."""
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({json_type(value)})"


def is_int(value: Any) -> bool:
    """True for a JSON integer (a Python int that is not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def type_error(name: str, expected: str, value: Any) -> ProtocolError:
    """The `ProtocolError` for field ``name`` holding ``value`` instead of ``expected``."""
    return ProtocolError(f"'{name}' must be {expected}, got {describe_json(value)}", param=name)


_KIND_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "number": ("a number", _is_number),
    "integer": ("an integer", is_int),
    "boolean": ("a boolean", lambda v: isinstance(v, bool)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "string_list": (
        "a list of strings",
        lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
    ),
    "stop": (
        "a string or a list of strings",
        lambda v: (
            isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
        ),
    ),
    "integer_list": (
        "a list of integers",
        lambda v: isinstance(v, list) and all(is_int(i) for i in v),
    ),
}


def checked_field(body: dict[str, Any], name: str, kind: str) -> Any:
    """``body[name]`` checked against a JSON ``kind``; None when absent or null."""
    value = body.get(name)
    expected, ok = _KIND_CHECKS[kind]
    if value is not None and not ok(value):
        raise type_error(name, expected, value)
    return value


# ---------------------------------------------------------------------------------------------
# Requests the engine refused


def rejected_error(request: ApiRequest, err: Exception) -> tuple[str, str]:
    """``(code, param)`` of the error for a request the engine refused with ``err``.

    The code and field the error carries (``err.code``, ``err.param``: e.g.
    ``context_length_exceeded`` and ``max_tokens`` when prompt + max_tokens exceed the
    context; ``max_tokens`` becomes ``max_completion_tokens`` when the request set that), else
    ``invalid_prompt``; the field defaults to the prompt's (``messages`` for chat, ``prompt``
    for completions): empty, too long, ids outside the vocabulary, text that cannot be
    tokenized.
    """
    code = getattr(err, "code", None) or INVALID_PROMPT
    param = getattr(err, "param", None) or ("messages" if request.is_chat else "prompt")
    if param == "max_tokens":
        param = request.max_tokens_field
    elif param == "structured_outputs" and request.structured_outputs_field:
        param = request.structured_outputs_field
    return code, param
