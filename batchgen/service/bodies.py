"""JSON request bodies: parsed with limits (nesting depth, valid Unicode), and large online
bodies parsed in a child process so that the event loop keeps answering.

Why a process: ``json.loads`` holds the GIL for the whole parse (about 30 ms per MB here, 3-4 s
for a 114 MB token-id body), so parsing on a worker thread still froze every other route
(``/health`` stalled 2.8 s in a measurement). A body over `LARGE_BODY_BYTES` therefore goes to
``python -m batchgen.service.bodies``, one at a time, which parses and validates it
(`parse_online_body`, including the O(1) prompt length checks of `check_prompt_size`) and sends
back only the validated request: a 20-million-id prompt is refused in the child, and the server
never holds the list. Smaller bodies are parsed inline (under ~30 ms).

Every JSON body is refused (400, an OpenAI error object naming the field) when it is nested
deeper than `MAX_JSON_DEPTH` levels, or when a string or key holds a lone UTF-16 surrogate
(``"\\ud800"`` is valid JSON but not text: it cannot be stored, logged or sent back as UTF-8).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.engine.input_processor import check_prompt_size
from batchgen.engine.prompt_bounds import PromptBound
from batchgen.entrypoints.openai_protocol import (
    CONTEXT_LENGTH_EXCEEDED,
    UNSUPPORTED_PARAMETER,
    ApiRequest,
    ProtocolError,
    parse_request_body,
)
from batchgen.service.errors import APIError

MAX_JSON_DEPTH = 64
LARGE_BODY_BYTES = 1 << 20
# Seconds a child may take to parse one body before it is killed.
_CHILD_TIMEOUT_S = 300.0
# Only a JSON escape can make a lone surrogate (raw UTF-8 cannot encode one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt must fit (`LLMEngine.input_processor`'s limits), for `check_prompt_size`."""

    max_model_len: int
    bound: PromptBound


@dataclass(frozen=True)
class OnlineBody:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` body."""

    api: ApiRequest
    stream: bool
    include_usage: bool


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body.

    Raises:
        APIError: 400 with code ``invalid_json`` (not JSON, not an object, NaN/Infinity, nested
            more than `MAX_JSON_DEPTH` levels) or ``invalid_unicode`` (a string or key with a
            lone surrogate; ``param`` names where).
    """
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as err:
        message = f"the request body is not valid JSON ({err})"
        raise APIError(400, message, code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    # Walk the body only when it could be that deep / hold a surrogate: O(1) for most bodies.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(body, MAX_JSON_DEPTH):
        raise _too_deep()
    if _SURROGATE_ESCAPE.search(raw):
        _check_unicode(body)
    return body


def _too_deep() -> APIError:
    return APIError(
        400,
        f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
        code="invalid_json",
    )


def _deeper_than(body: Any, limit: int) -> bool:
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def _check_unicode(body: dict[str, Any]) -> None:
    """Raise `APIError` for the first string or key (depth first) holding a lone surrogate."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                raise APIError(
                    400,
                    f"'{path}' is not valid Unicode text: it holds a lone surrogate "
                    f"{_shown(value)}; send characters outside the Basic Multilingual Plane "
                    "as surrogate pairs",
                    param=path,
                    code="invalid_unicode",
                )
        elif isinstance(value, dict):
            for key, child in value.items():
                if not _encodable(key):
                    where = f"'{path}'" if path else "the request body"
                    raise APIError(
                        400,
                        f"{where} has a key that is not valid Unicode text (a lone surrogate "
                        f"{_shown(key)})",
                        param=path or None,
                        code="invalid_unicode",
                    )
                stack.append((f"{path}.{key}" if path else key, child))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(value))


def _encodable(text: str) -> bool:
    return _first_surrogate(text) is None


def _first_surrogate(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def _shown(text: str) -> str:
    """Where in ``text`` its first lone surrogate is, e.g. ``at character 3 ("abc\\ud800")``,
    with up to 10 characters around it, as ASCII JSON."""
    at = _first_surrogate(text) or 0
    start, end = max(at - 10, 0), at + 11
    shown = json.dumps(text[start:end])
    if start:
        shown = '"...' + shown[1:]
    if end < len(text):
        shown = shown[:-1] + '..."'
    return f"at character {at} ({shown})"


# ---------------------------------------------------------------------------------------------
# Online bodies


def parse_online_body(raw: bytes, url: str, limits: PromptLimits | None) -> OnlineBody:
    """Validate the body of an online completions / chat completions request.

    ``limits`` (None: no size check here) refuses a completions prompt that cannot fit, by its
    length (`check_prompt_size`); the engine still checks every prompt exactly.

    Raises:
        APIError: 400 with the field named (see `parse_json_object`, `parse_request_body`),
            ``context_length_exceeded`` for a prompt that cannot fit.
    """
    body = parse_json_object(raw)
    stream = body.pop("stream", False)
    options = body.pop("stream_options", None)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", param="stream")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    try:
        api = parse_request_body(url, body)
    except ProtocolError as err:
        raise APIError(400, str(err), param=err.param, code=err.code) from None
    for name in ("logprobs", "prompt_logprobs"):
        if stream and getattr(api.sampling_params, name) is not None:
            raise APIError(
                400,
                f"'{name}' cannot be combined with 'stream' in BatchGen",
                param=name,
                code=UNSUPPORTED_PARAMETER,
            )
    if limits is not None and api.prompt is not None:
        try:
            check_prompt_size(api.prompt, limits.max_model_len, limits.bound)
        except ValueError as err:
            raise APIError(400, str(err), param="prompt", code=CONTEXT_LENGTH_EXCEEDED) from None
    return OnlineBody(api, stream, include_usage)


class OnlineBodyParser:
    """Parses online bodies inline when small, in a child process when large (one at a time).

    Args:
        limits: the engine's prompt limits, or None.
    """

    def __init__(self, limits: PromptLimits | None) -> None:
        self.limits = limits
        self._child_slot = asyncio.Semaphore(1)  # a large parse may take GBs for a moment

    async def parse(self, raw: bytes, url: str) -> OnlineBody:
        """`parse_online_body`, off the event loop for bodies over `LARGE_BODY_BYTES`."""
        if len(raw) <= LARGE_BODY_BYTES:
            return parse_online_body(raw, url, self.limits)
        async with self._child_slot:
            return await self._parse_in_child(raw, url)

    async def _parse_in_child(self, raw: bytes, url: str) -> OnlineBody:
        header = pickle.dumps((url, self.limits))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this batchgen
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=env,
        )
        try:
            frame = len(header).to_bytes(8, "little") + header + raw
            out, _ = await asyncio.wait_for(proc.communicate(frame), _CHILD_TIMEOUT_S)
        finally:
            if proc.returncode is None:  # timed out, or the client went away
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if proc.returncode != 0 or not out:
            raise APIError(
                500,
                f"the request body could not be parsed (the parser exited with {proc.returncode})",
                code="internal_error",
            )
        result = pickle.loads(out)  # our own child's answer
        if result[0] == "error":
            _, status, message, param, code = result
            raise APIError(status, message, param=param, code=code)
        return result[1]


def _child_main() -> None:
    """``python -m batchgen.service.bodies``: stdin = 8-byte header length, pickled
    ``(url, limits)``, then the body; stdout = pickled ``("ok", OnlineBody)`` or
    ``("error", status, message, param, code)``."""
    data = sys.stdin.buffer.read()
    size = int.from_bytes(data[:8], "little")
    url, limits = pickle.loads(data[8 : 8 + size])
    raw = data[8 + size :]
    del data
    try:
        result: tuple = ("ok", parse_online_body(raw, url, limits))
    except APIError as err:
        result = ("error", err.status_code, err.message, err.param, err.code)
    sys.stdout.buffer.write(pickle.dumps(result))


if __name__ == "__main__":
    # Run the imported module's copy, so that results pickle as batchgen.service.bodies types
    # (not __main__ ones, which the server cannot resolve).
    from batchgen.service.bodies import _child_main as main

    main()
