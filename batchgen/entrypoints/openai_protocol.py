"""OpenAI API requests and responses <-> BatchGen requests and outputs. Pure functions, no I/O.

Shared by ``batchgen run`` (OpenAI Batch API files) and the HTTP service. Two layers:

* **Bodies** (`parse_request_body`): the JSON body of a ``/v1/completions`` or
  ``/v1/chat/completions`` request -> `ApiRequest` (prompt or messages + `SamplingParams`).
  `completion_response_body` / `chat_response_body` (in `batchgen.entrypoints.openai_responses`,
  re-exported here) turn a finished `RequestOutput` back into the OpenAI ``text_completion`` /
  ``chat.completion`` object.
* **Batch lines** (`parse_batch_line`): one line of an OpenAI Batch input file, either the
  envelope ``{"custom_id", "method": "POST", "url", "body"}`` or a plain body such as
  ``{"prompt": "..."}`` (a completion; with ``"messages"`` a chat completion) whose
  ``custom_id`` defaults to ``line-<N>``. `success_line` / `error_line` build output lines.

Field policy (what a body may contain):

* OpenAI sampling fields map to `SamplingParams`: ``max_tokens`` (chat: also
  ``max_completion_tokens``, which wins), ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``,
  ``presence_penalty``, ``frequency_penalty``, ``logprobs`` (completions: int top-N; chat: bool,
  with int ``top_logprobs``). Defaults are OpenAI's: completions ``max_tokens`` 16, chat
  ``max_tokens`` None (until ``max_model_len``), ``temperature`` 1. An explicit JSON ``null``
  means "default", except ``max_tokens: null`` which means "until ``max_model_len``".
* vLLM's extra sampling fields are accepted with vLLM's names: ``top_k``, ``min_p``,
  ``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
  ``include_stop_str_in_output``, ``skip_special_tokens``, ``bad_words``,
  ``prompt_logprobs`` (returned as vLLM's server does: in each completions choice, at the top
  of a chat completion).
* ``logit_bias`` (OpenAI's token id -> bias in [-100, 100]; JSON keys are strings of token
  ids): checked by `SamplingParams`, ids against the vocabulary when the engine takes the
  request; an invalid map fails that request alone with ``param`` ``logit_bias``.
* Structured outputs (`batchgen.entrypoints.structured_body`): OpenAI's ``response_format``
  (``text``, ``json_object``, ``json_schema``), vLLM's ``structured_outputs`` and its older
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``; at most one of them.
  An invalid schema, regex or grammar is an ``invalid_request`` whose ``param`` is the body
  field that carried it (e.g. ``response_format.json_schema.schema``, ``guided_regex``).
* ``model`` is informational (one engine serves one model); responses name the engine's model.
* Fields that do not change the generated text are ignored: ``user``, ``metadata``, ``store``,
  ``service_tier``, ``stream_options``, ``parallel_tool_calls``, ``prompt_cache_key``,
  ``safety_identifier``.
* Fields BatchGen cannot honour are accepted only at their no-op value and rejected otherwise
  (code ``unsupported_parameter``): ``stream`` (false), ``echo`` (false), ``suffix``
  (null/""), ``best_of`` (null or == n),
  ``tools``/``functions`` (null/[]), ``tool_choice``/
  ``function_call`` (null/"none"), ``modalities`` (null/["text"]).
* Any other field is rejected, like the OpenAI API does, so that a typo (``max_token``) does
  not silently run with defaults; the message suggests the closest known field.

Errors are `ProtocolError` (a ValueError) carrying an OpenAI-style ``code`` and the offending
``param``; batch-line errors are `BatchLineError`, which adds the ``custom_id`` (None when the
line has none) and the 1-based line number.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.entrypoints.openai_responses import (  # noqa: F401  (re-exported)
    MIN_LOGPROB,
    chat_logprobs,
    chat_response_body,
    completion_logprobs,
    completion_response_body,
    dumps_line,
    error_line,
    response_body,
    success_line,
    usage,
)
from batchgen.entrypoints.custom_id_salvage import salvage_custom_id
from batchgen.entrypoints.structured_body import (
    STRUCTURED_BODY_FIELDS,
    BodyFieldError,
    param_for,
    parse_structured_fields,
)
from batchgen.sampling_params import SamplingParams

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
SUPPORTED_URLS = (COMPLETIONS_URL, CHAT_COMPLETIONS_URL)

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

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# OpenAI name -> (JSON kind, SamplingParams name). Kinds are checked here; ranges by
# SamplingParams, whose messages name the field.
_SAMPLING_FIELDS: dict[str, tuple[str, str]] = {
    "temperature": ("number", "temperature"),
    "top_p": ("number", "top_p"),
    "n": ("integer", "n"),
    "seed": ("integer", "seed"),
    "stop": ("stop", "stop"),
    "presence_penalty": ("number", "presence_penalty"),
    "frequency_penalty": ("number", "frequency_penalty"),
    "top_k": ("integer", "top_k"),
    "min_p": ("number", "min_p"),
    "min_tokens": ("integer", "min_tokens"),
    "repetition_penalty": ("number", "repetition_penalty"),
    "ignore_eos": ("boolean", "ignore_eos"),
    "stop_token_ids": ("integer_list", "stop_token_ids"),
    "include_stop_str_in_output": ("boolean", "include_stop_str_in_output"),
    "skip_special_tokens": ("boolean", "skip_special_tokens"),
    "logit_bias": ("object", "logit_bias"),
    "bad_words": ("string_list", "bad_words"),
    "prompt_logprobs": ("integer", "prompt_logprobs"),
}
_IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "stream_options",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
    }
)
# Field -> (allowed no-op values, description of them for the error message).
_NOOP_ONLY_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "stream": ((None, False), "false (results are written to the output, not streamed)"),
    "tools": ((None, []), "null or []"),
    "functions": ((None, []), "null or []"),
    "tool_choice": ((None, "none"), 'null or "none"'),
    "function_call": ((None, "none"), 'null or "none"'),
    "modalities": ((None, ["text"]), 'null or ["text"]'),
}
_COMPLETION_NOOP_ONLY = {
    "echo": ((None, False), "false"),
    "suffix": ((None, ""), 'null or ""'),
}
_COMPLETION_FIELDS = frozenset(
    {"model", "prompt", "max_tokens", "logprobs", "best_of"}
    | _SAMPLING_FIELDS.keys()
    | _IGNORED_FIELDS
    | _NOOP_ONLY_FIELDS.keys()
    | STRUCTURED_BODY_FIELDS
    | _COMPLETION_NOOP_ONLY.keys()
)
_CHAT_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"}
    | _SAMPLING_FIELDS.keys()
    | _IGNORED_FIELDS
    | _NOOP_ONLY_FIELDS.keys()
    | STRUCTURED_BODY_FIELDS
)
_ENVELOPE_KEYS = ("url", "method", "body")


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


@dataclass(frozen=True)
class ApiRequest:
    """A validated completions or chat-completions request.

    Attributes:
        url: ``COMPLETIONS_URL`` or ``CHAT_COMPLETIONS_URL``.
        prompt: completions: the prompt text or token ids; None for chat.
        messages: chat: the messages, content flattened to strings and role ``developer``
            mapped to ``system`` (chat templates know ``system``); None for completions.
        sampling_params: the generation settings. For chat, ``logprobs`` holds ``top_logprobs``
            (0 when only ``logprobs: true``) and None when log-probabilities were not asked.
        model: the body's ``model``, informational only.
        max_tokens_field: the body field that set ``sampling_params.max_tokens``
            (``max_completion_tokens`` when a chat request used it), named in errors.
        structured_outputs_field: the body field that set
            ``sampling_params.structured_outputs`` (e.g. ``response_format.json_schema.schema``),
            named in errors; None when the request is not constrained.
    """

    url: str
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    sampling_params: SamplingParams
    model: str | None = None
    max_tokens_field: str = "max_tokens"
    structured_outputs_field: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_COMPLETIONS_URL


@dataclass(frozen=True)
class BatchRequest:
    """One valid batch input line: its ``custom_id``, 1-based ``line`` number and request."""

    custom_id: str
    line: int
    request: ApiRequest


# ---------------------------------------------------------------------------------------------
# JSON type checks


def _json_type(value: Any) -> str:
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


def _describe(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({_json_type(value)})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_error(name: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(f"'{name}' must be {expected}, got {_describe(value)}", param=name)


_KIND_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "number": ("a number", _is_number),
    "integer": ("an integer", _is_int),
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
        lambda v: isinstance(v, list) and all(_is_int(i) for i in v),
    ),
}


def _checked(body: dict[str, Any], name: str, kind: str) -> Any:
    """``body[name]`` checked against a JSON ``kind``; None when absent or null."""
    value = body.get(name)
    expected, ok = _KIND_CHECKS[kind]
    if value is not None and not ok(value):
        raise _type_error(name, expected, value)
    return value


# ---------------------------------------------------------------------------------------------
# Request bodies


def parse_request_body(url: str, body: Any) -> ApiRequest:
    """Validate the JSON body of a request to ``url`` and map it to an `ApiRequest`.

    Args:
        url: ``"/v1/completions"`` or ``"/v1/chat/completions"``.
        body: the decoded JSON body.

    Raises:
        ProtocolError: unknown url (code ``invalid_url``), body not an object, missing prompt
            or messages, a field of the wrong type or out of range, ``stream: true`` or another
            unsupported / unknown field. The message names the field and what it allows.
    """
    if url not in SUPPORTED_URLS:
        raise ProtocolError(
            f"'url' must be one of {list(SUPPORTED_URLS)}, got {_describe(url)}",
            code=INVALID_URL,
            param="url",
        )
    if not isinstance(body, dict):
        raise _type_error("body", "an object", body)
    is_chat = url == CHAT_COMPLETIONS_URL
    _check_fields(body, url, _CHAT_FIELDS if is_chat else _COMPLETION_FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    kwargs = _sampling_kwargs(body)
    try:
        spec, spec_field = parse_structured_fields(body)
    except BodyFieldError as err:
        raise ProtocolError(str(err), code=err.code, param=err.param) from None
    if spec is not None:
        kwargs["structured_outputs"] = spec
    if is_chat:
        messages = parse_messages(body.get("messages"))
        kwargs.update(_chat_length_and_logprobs(body))
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
        return ApiRequest(
            url,
            None,
            messages,
            _sampling_params(kwargs, is_chat, spec_field),
            model,
            max_tokens_field=field or "max_tokens",
            structured_outputs_field=spec_field,
        )
    prompt = _parse_prompt(body.get("prompt"))
    kwargs.update(_completion_length_and_logprobs(body, n=kwargs.get("n", 1)))
    return ApiRequest(
        url,
        prompt,
        None,
        _sampling_params(kwargs, is_chat, spec_field),
        model,
        structured_outputs_field=spec_field,
    )


def _check_fields(body: dict[str, Any], url: str, known: frozenset[str]) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        # The other endpoint's input field: point at the right one.
        if name == "prompt" and "messages" in known:
            hint = "; /v1/chat/completions takes 'messages', /v1/completions takes 'prompt'"
        elif name == "messages" and "prompt" in known:
            hint = "; /v1/completions takes 'prompt', /v1/chat/completions takes 'messages'"
        raise ProtocolError(
            f"unknown field '{name}' for {url}{hint}", code=UNSUPPORTED_PARAMETER, param=name
        )
    noop_only = dict(_NOOP_ONLY_FIELDS)
    if url == COMPLETIONS_URL:
        noop_only.update(_COMPLETION_NOOP_ONLY)
    for name, (allowed, words) in noop_only.items():
        if name in body and not any(
            body[name] == a and type(body[name]) is type(a) for a in allowed
        ):
            raise ProtocolError(
                f"'{name}' is not supported by BatchGen; it must be {words}, "
                f"got {_describe(body[name])}",
                code=UNSUPPORTED_PARAMETER,
                param=name,
            )


def _sampling_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name, (kind, sp_name) in _SAMPLING_FIELDS.items():
        value = _checked(body, name, kind)
        if value is not None:
            kwargs[sp_name] = value
    return kwargs


def _completion_length_and_logprobs(body: dict[str, Any], n: int) -> dict[str, Any]:
    max_tokens = _checked(body, "max_tokens", "integer") if "max_tokens" in body else 16
    logprobs = body.get("logprobs")
    if logprobs is not None and not _is_int(logprobs):
        hint = " (booleans are for chat; here it is the number of top tokens)"
        raise _type_error("logprobs", "an integer" + hint, logprobs)
    best_of = _checked(body, "best_of", "integer")
    if best_of is not None and best_of != n:
        raise ProtocolError(
            f"'best_of' is not supported by BatchGen; it must be null or equal to n ({n}), "
            f"got {best_of}",
            code=UNSUPPORTED_PARAMETER,
            param="best_of",
        )
    return {"max_tokens": max_tokens, "logprobs": logprobs}


def _chat_length_and_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    max_tokens = _checked(body, "max_tokens", "integer")
    max_completion_tokens = _checked(body, "max_completion_tokens", "integer")
    want_logprobs = _checked(body, "logprobs", "boolean")
    top_logprobs = _checked(body, "top_logprobs", "integer")
    if top_logprobs is not None and not want_logprobs:
        raise ProtocolError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    return {
        "max_tokens": max_completion_tokens if max_completion_tokens is not None else max_tokens,
        "logprobs": (top_logprobs or 0) if want_logprobs else None,
    }


def _sampling_params(
    kwargs: dict[str, Any], is_chat: bool, spec_field: str | None = None
) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as err:
        # SamplingParams' messages start with its field name; name the OpenAI one instead.
        # They speak Python ("or None", vLLM's wording); a JSON body writes that null.
        message = str(err).replace(" or None, ", " or null, ")
        field = message.split(" ", 1)[0]
        if is_chat and field == "logprobs":
            message, field = "top_logprobs" + message[len("logprobs") :], "top_logprobs"
        elif field.startswith("structured_outputs"):
            message, field = param_for(message, spec_field)
        raise ProtocolError(message, param=field) from None


def _parse_prompt(prompt: Any) -> str | list[int]:
    """A completions prompt: a string or a list of token ids (one prompt per request)."""
    if prompt is None:
        raise ProtocolError(
            "missing 'prompt' (a string or a list of token ids)",
            code=MISSING_REQUIRED_PARAMETER,
            param="prompt",
        )
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise ProtocolError(
                f"'prompt' holds {len(prompt)} prompts; a request carries one prompt "
                "(write one batch line per prompt)",
                code=UNSUPPORTED_PARAMETER,
                param="prompt",
            )
        prompt = prompt[0]  # ["text"] or [[1, 2, 3]]: one prompt in OpenAI's array form
    if isinstance(prompt, str):
        if not prompt:
            raise ProtocolError("'prompt' must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if min(prompt) < 0:
            raise ProtocolError("'prompt' token ids must be >= 0", param="prompt")
        return prompt
    raise _type_error("prompt", "a non-empty string or a non-empty list of token ids", prompt)


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise ProtocolError(
            "missing 'messages' (a list of {role, content} objects)",
            code=MISSING_REQUIRED_PARAMETER,
            param="messages",
        )
    if not isinstance(messages, list) or not messages:
        raise _type_error("messages", "a non-empty list of {role, content} objects", messages)
    return [_parse_message(m, i) for i, m in enumerate(messages)]


def _parse_message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _type_error(where, "an object with 'role' and 'content'", message)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ProtocolError(
            f"'{where}.role' must be one of {list(CHAT_ROLES)}, got {_describe(role)}",
            param=f"{where}.role",
        )
    content = message.get("content")
    if content is None and role != "assistant":  # assistant turns may carry only tool calls
        raise ProtocolError(
            f"'{where}.content' is required for role '{role}'",
            code=MISSING_REQUIRED_PARAMETER,
            param=f"{where}.content",
        )
    parsed = dict(message)
    parsed["role"] = "system" if role == "developer" else role
    parsed["content"] = _flatten_content(content, f"{where}.content")
    return parsed


def _flatten_content(content: Any, where: str) -> str:
    """Message content as one string: text parts are joined with newlines (as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(where, "a string or a list of text parts", content)
    texts = []
    for i, part in enumerate(content):
        is_text = isinstance(part, dict) and part.get("type") == "text"
        if not is_text or not isinstance(part.get("text"), str):
            raise ProtocolError(
                f'\'{where}[{i}]\' must be a text part {{"type": "text", "text": ...}}; '
                f"BatchGen serves text-only models, got {_describe(part)}",
                code=UNSUPPORTED_PARAMETER,
                param=f"{where}[{i}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


# ---------------------------------------------------------------------------------------------
# Batch input lines


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
            f"a batch line must be a JSON object, got {_json_type(obj)}",
            line=line,
            custom_id=None,
            code=INVALID_JSON_LINE,
        )
    return obj


def _custom_id(value: Any, line: int) -> str:
    if not isinstance(value, str) or not value:
        raise BatchLineError(
            f"'custom_id' must be a non-empty string, got {_describe(value)}",
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
            f"'method' must be \"POST\", got {_describe(method)}",
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
# Errors


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


def error_line_from(err: BatchLineError) -> dict[str, Any]:
    """The output line of a batch line that failed to parse."""
    return error_line(err.custom_id, err.code, str(err), param=err.param, line=err.line)
