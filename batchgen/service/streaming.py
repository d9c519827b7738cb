"""Server-sent events for ``stream: true`` on ``/v1/completions`` and ``/v1/chat/completions``.

Chunks follow OpenAI's streaming objects: ``text_completion`` chunks with ``choices[i].text``,
``chat.completion.chunk`` chunks with ``choices[i].delta`` (``role`` in the first chunk of each
choice, then ``content``); the last chunk of a choice carries its ``finish_reason`` (and vLLM's
``stop_reason``); with ``stream_options.include_usage`` a final chunk has empty ``choices`` and
the ``usage``; the stream ends with ``data: [DONE]``. Log-probabilities are not streamed (the
routes reject ``logprobs`` together with ``stream``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from batchgen.entrypoints.openai_protocol import usage
from batchgen.outputs import RequestOutput

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    """One SSE event carrying ``data`` as compact JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode("utf-8") + b"\n\n"


class StreamFormatter:
    """Builds the chunks of one streamed response.

    Args:
        is_chat: chat (``chat.completion.chunk``) or completions (``text_completion``).
        model: the ``model`` field of every chunk.
        include_usage: add the final usage chunk (``stream_options.include_usage``).
    """

    def __init__(self, *, is_chat: bool, model: str, include_usage: bool) -> None:
        self.is_chat = is_chat
        self.model = model
        self.include_usage = include_usage
        prefix = "chatcmpl" if is_chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._started: set[int] = set()

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(
        self, index: int, text: str, finish_reason: str | None, stop_reason: Any
    ) -> dict[str, Any]:
        if not self.is_chat:
            return {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        delta: dict[str, Any] = {"content": text}
        if index not in self._started:
            delta = {"role": "assistant", "content": text}
            self._started.add(index)
        return {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def delta(self, index: int, text: str) -> bytes:
        """A chunk with new text of choice ``index``."""
        return sse(self._chunk([self._choice(index, text, None, None)]))

    def finish(self, output: RequestOutput, sent: dict[int, int]) -> bytes:
        """The last chunks: each choice's unsent text with its finish reason, the usage chunk
        when asked, and ``[DONE]``. ``sent[i]``: characters of choice ``i`` already sent."""
        events = []
        for sample in sorted(output.outputs, key=lambda o: o.index):
            rest = sample.text[sent.get(sample.index, 0) :]
            choice = self._choice(sample.index, rest, sample.finish_reason, sample.stop_reason)
            events.append(sse(self._chunk([choice])))
        if self.include_usage:
            chunk = self._chunk([])
            chunk["usage"] = usage(output)
            events.append(sse(chunk))
        events.append(DONE)
        return b"".join(events)

    @staticmethod
    def error(status: int, message: str, code: str | None) -> bytes:
        """An error event after the stream started (its HTTP status was already 200)."""
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        return sse(body) + DONE
