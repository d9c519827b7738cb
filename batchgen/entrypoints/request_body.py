"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` -> `ApiRequest`
(`parse_request_body`). Pure functions, no I/O. Chat messages are checked by
`batchgen.entrypoints.chat_messages`, structured-output fields by
`batchgen.entrypoints.structured_body`.

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


Errors are `ProtocolError` (`batchgen.entrypoints.openai_errors`) naming the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.config_fields import close_name
from batchgen.entrypoints.chat_messages import parse_messages
from batchgen.entrypoints.openai_errors import (
    INVALID_URL,
    MISSING_REQUIRED_PARAMETER,
    UNSUPPORTED_PARAMETER,
    ProtocolError,
    checked_field,
    describe_json,
    is_int,
    type_error,
)
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
            f"'url' must be one of {list(SUPPORTED_URLS)}, got {describe_json(url)}",
            code=INVALID_URL,
            param="url",
        )
    if not isinstance(body, dict):
        raise type_error("body", "an object", body)
    is_chat = url == CHAT_COMPLETIONS_URL
    _check_fields(body, url, _CHAT_FIELDS if is_chat else _COMPLETION_FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise type_error("model", "a string", model)
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
        close = close_name(name, known)
        hint = f"; did you mean '{close}'?" if close else ""
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
                f"got {describe_json(body[name])}",
                code=UNSUPPORTED_PARAMETER,
                param=name,
            )


def _sampling_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name, (kind, sp_name) in _SAMPLING_FIELDS.items():
        value = checked_field(body, name, kind)
        if value is not None:
            kwargs[sp_name] = value
    return kwargs


def _completion_length_and_logprobs(body: dict[str, Any], n: int) -> dict[str, Any]:
    max_tokens = checked_field(body, "max_tokens", "integer") if "max_tokens" in body else 16
    logprobs = body.get("logprobs")
    if logprobs is not None and not is_int(logprobs):
        hint = " (booleans are for chat; here it is the number of top tokens)"
        raise type_error("logprobs", "an integer" + hint, logprobs)
    best_of = checked_field(body, "best_of", "integer")
    if best_of is not None and best_of != n:
        raise ProtocolError(
            f"'best_of' is not supported by BatchGen; it must be null or equal to n ({n}), "
            f"got {best_of}",
            code=UNSUPPORTED_PARAMETER,
            param="best_of",
        )
    return {"max_tokens": max_tokens, "logprobs": logprobs}


def _chat_length_and_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    max_tokens = checked_field(body, "max_tokens", "integer")
    max_completion_tokens = checked_field(body, "max_completion_tokens", "integer")
    want_logprobs = checked_field(body, "logprobs", "boolean")
    top_logprobs = checked_field(body, "top_logprobs", "integer")
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
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        if min(prompt) < 0:
            raise ProtocolError("'prompt' token ids must be >= 0", param="prompt")
        return prompt
    raise type_error("prompt", "a non-empty string or a non-empty list of token ids", prompt)
