"""OpenAI response objects and batch output lines, built from finished `RequestOutput`s.
Pure functions, no I/O; re-exported by `batchgen.entrypoints.openai_protocol`, as is the
request side (`request_body`, `chat_messages`, `batch_lines`, `openai_errors`).

* `completion_response_body` / `chat_response_body` (`response_body` picks one): the OpenAI
  ``text_completion`` / ``chat.completion`` objects, with ``logprobs`` in each API's shape.
* `success_line` / `error_line`: one line of an OpenAI Batch output file; `error_line_from` the
  error line of a batch line that failed to parse; `dumps_line` a line's text.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import TYPE_CHECKING, Any

from batchgen.engine.detokenizer import token_bytes
from batchgen.entrypoints.openai_errors import DUPLICATE_CUSTOM_ID
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput

if TYPE_CHECKING:
    from batchgen.entrypoints.openai_errors import BatchLineError
    from batchgen.entrypoints.request_body import ApiRequest

# OpenAI clamps -inf log-probabilities the same way (vLLM does too): JSON has no infinity.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _token_text(token_id: int, logprob: Logprob | None, tokenizer: Any) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def _by_rank(step: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    # Unranked entries (should not happen) sort last.
    return sorted(step.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))


def completion_logprobs(sample: CompletionOutput, tokenizer: Any) -> dict[str, Any] | None:
    """OpenAI completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    ``top_logprobs[i]`` maps token text -> logprob for the top-N tokens plus the sampled one
    (so up to N+1 entries, as OpenAI documents), most likely first. Different tokens can
    decode to the same text (e.g. lone bytes of a multi-byte character all decode to U+FFFD);
    such a text keeps the highest of their logprobs, so the sampled token's text is always a
    key, with at least its own logprob. ``text_offset[i]`` is the character offset of
    token i in the generated text (0 = start of the completion). Log-probabilities are natural
    logs, -inf clamped to ``MIN_LOGPROB``. None when the request did not ask for logprobs.
    """
    if sample.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    for token_id, step in zip(sample.token_ids, sample.logprobs, strict=True):
        chosen = step.get(token_id)
        text = _token_text(token_id, chosen, tokenizer)
        tokens.append(text)
        token_logprobs.append(None if chosen is None else _finite(chosen.logprob))
        top_logprobs.append(_top_logprobs_by_text(step, tokenizer))
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def _top_logprobs_by_text(step: dict[int, Logprob], tokenizer: Any) -> dict[str, float]:
    """Token text -> logprob, by rank; a text that several tokens decode to keeps the highest."""
    top: dict[str, float] = {}
    for token_id, lp in _by_rank(step):
        text, logprob = _token_text(token_id, lp, tokenizer), _finite(lp.logprob)
        if text not in top or logprob > top[text]:
            top[text] = logprob
    return top


def _chat_token(token_id: int, lp: Logprob | None, tokenizer: Any) -> dict[str, Any]:
    text = _token_text(token_id, lp, tokenizer)
    # The token's own bytes (half a multi-byte character stays half), as OpenAI reports.
    raw = (
        token_bytes(tokenizer, token_id)
        if tokenizer is not None
        else text.encode("utf-8", errors="replace")
    )
    return {
        "token": text,
        "logprob": MIN_LOGPROB if lp is None else _finite(lp.logprob),
        "bytes": list(raw),
    }


def chat_logprobs(
    sample: CompletionOutput, tokenizer: Any, top_logprobs: int
) -> dict[str, Any] | None:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``.

    ``top_logprobs`` of each token lists exactly the ``top_logprobs`` most likely tokens (by
    rank), each ``{token, logprob, bytes}`` with ``bytes`` the token's raw bytes (`token_bytes`).
    None when the request did not ask for logprobs.
    """
    if sample.logprobs is None:
        return None
    content = []
    for token_id, step in zip(sample.token_ids, sample.logprobs, strict=True):
        chosen = step.get(token_id)
        entry = _chat_token(token_id, chosen, tokenizer)
        entry["top_logprobs"] = [
            _chat_token(t, lp, tokenizer) for t, lp in _by_rank(step)[:top_logprobs]
        ]
        content.append(entry)
    return {"content": content}


def usage(output: RequestOutput) -> dict[str, int]:
    """OpenAI ``usage``: prompt tokens (once per request), generated tokens over all samples."""
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = output.num_generated_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response_body(
    output: RequestOutput, *, model: str, tokenizer: Any, created: int | None = None
) -> dict[str, Any]:
    """The OpenAI ``text_completion`` object of a finished request (one choice per sample).

    ``created`` is a Unix time in seconds (default: now). Choices carry vLLM's extra
    ``stop_reason`` (the stop string or token id that ended the sample, else null) and, when
    the request asked for them, vLLM's ``prompt_logprobs`` (`prompt_logprobs_json`).
    """
    prompt = prompt_logprobs_json(output)
    choices = [
        {
            "index": sample.index,
            "text": sample.text,
            "logprobs": completion_logprobs(sample, tokenizer),
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }
        for sample in output.outputs
    ]
    if prompt is not None:
        for choice in choices:
            choice["prompt_logprobs"] = prompt
    return _response_body("cmpl", "text_completion", output, model, choices, created)


def chat_response_body(
    output: RequestOutput,
    *,
    model: str,
    tokenizer: Any,
    top_logprobs: int | None,
    created: int | None = None,
) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` object of a finished request (one choice per sample).

    ``top_logprobs``: the number of alternatives per token in ``logprobs`` (the request's
    ``SamplingParams.logprobs``); None when not asked. ``created``: Unix seconds (default now).
    When the request asked for them, vLLM's ``prompt_logprobs`` sit at the top of the object
    (`prompt_logprobs_json`), as vLLM's server puts them.
    """
    choices = [
        {
            "index": sample.index,
            "message": {"role": "assistant", "content": sample.text},
            "logprobs": None
            if top_logprobs is None
            else chat_logprobs(sample, tokenizer, top_logprobs),
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }
        for sample in output.outputs
    ]
    body = _response_body("chatcmpl", "chat.completion", output, model, choices, created)
    prompt = prompt_logprobs_json(output)
    if prompt is not None:
        body["prompt_logprobs"] = prompt
    return body


def prompt_logprobs_json(output: RequestOutput) -> list[dict[str, dict] | None] | None:
    """``output.prompt_logprobs`` as vLLM's server writes them: per prompt token None (the
    first) or ``{"<token_id>": {"logprob", "rank", "decoded_token"}}``, the top-N by rank then
    the actual token; logprobs finite (-inf as ``MIN_LOGPROB``). None when not asked for."""
    if output.prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            str(token_id): {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in step.items()
        }
        for step in output.prompt_logprobs
    ]


def _response_body(
    id_prefix: str,
    obj: str,
    output: RequestOutput,
    model: str,
    choices: list[dict[str, Any]],
    created: int | None,
) -> dict[str, Any]:
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": obj,
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": sorted(choices, key=lambda c: c["index"]),
        "usage": usage(output),
    }


def response_body(
    request: ApiRequest, output: RequestOutput, *, model: str, tokenizer: Any
) -> dict[str, Any]:
    """`completion_response_body` or `chat_response_body`, as ``request.url`` asks."""
    if request.is_chat:
        return chat_response_body(
            output,
            model=model,
            tokenizer=tokenizer,
            top_logprobs=request.sampling_params.logprobs,
        )
    return completion_response_body(output, model=model, tokenizer=tokenizer)


def success_line(custom_id: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """A batch output line for a request that completed (HTTP status 200)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(
    custom_id: str | None,
    code: str,
    message: str,
    *,
    line: int,
    param: str | None = None,
) -> dict[str, Any]:
    """A batch output line for a request that failed.

    Both shapes clients look for are filled: ``response`` carries HTTP 400 with an OpenAI
    error body ``{"error": {message, type, param, code}}`` (what OpenAI and vLLM write for a
    request the API rejected), and ``error`` is ``{code, message, param, line}`` (the keys of
    OpenAI's batch errors). ``line`` is the 1-based input line number, which lets ``--resume``
    recognise lines that had no usable custom_id; it is required, so that no error line of any
    path (parsing, admission, engine failure, cancel) goes out without it.
    """
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": 400,
            "request_id": f"req_{uuid.uuid4().hex}",
            "body": {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": param,
                    "code": code,
                }
            },
        },
        "error": {"code": code, "message": message, "param": param, "line": line},
    }


def dumps_line(obj: dict[str, Any]) -> str:
    """Compact JSON text of one output line (no newline), safe to encode as UTF-8.

    Non-ASCII text is kept as is; should text contain a lone surrogate (not encodable), the
    line falls back to ``\\u`` escapes.
    """
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, separators=(",", ":"))
    return text


def error_line_from(err: BatchLineError) -> dict[str, Any]:
    """The output line of a batch line that failed to parse."""
    return error_line(err.custom_id, err.code, str(err), param=err.param, line=err.line)


def duplicate_custom_id_line(custom_id: str, line: int, first_line: int) -> dict[str, Any]:
    """The output line of a batch line whose ``custom_id`` an earlier line already used.

    The message names both 1-based line numbers, ``line N: custom_id "x" already used on line
    M`` (the id JSON-quoted), so the user can find the first occurrence without searching.
    """
    message = f"line {line}: custom_id {json.dumps(custom_id)} already used on line {first_line}"
    return error_line(custom_id, DUPLICATE_CUSTOM_ID, message, param="custom_id", line=line)
