"""`BatchGenClient`: submit batches to a ``batchgen serve`` server and stream their results.

    client = BatchGenClient("http://127.0.0.1:8000")
    job = client.submit_batch(["Hello", "2 + 2 ="], max_tokens=32, temperature=0.0)
    for result in job.iter_results():      # as soon as each result is stored
        print(result.index, result.custom_id, result.text)

Built on ``httpx`` only (no torch import). Connection problems are retried with exponential
backoff for up to ``retry_timeout`` seconds, so a server restart in the middle of
`BatchJob.iter_results` or `BatchJob.wait` is survived: results are read from a cursor the
server keeps in its store, so none is lost or repeated. Requests that create something
(uploads, new batches, cancel) are retried only when the connection could not be opened, so a
retry never creates a second batch.

Modules: `BatchJob`, `BatchResult` and `BatchGenError` are in `batchgen.service.client_jobs`;
the grouping of input-file lines by endpoint in `batchgen.service.client_input`. Both are
re-exported here, the import path users know.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from batchgen.service.client_input import (  # noqa: F401 (re-exported)
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    SUPPORTED_URLS,
    EndpointLines,
    line_endpoint,
    split_by_endpoint,
)
from batchgen.service.client_jobs import (  # noqa: F401 (re-exported)
    TERMINAL_STATUSES,
    BatchGenError,
    BatchJob,
    BatchResult,
)

logger = logging.getLogger(__name__)

_RETRY_STATUSES = frozenset({502, 503, 504})
_BACKOFF_START_S = 0.2
_BACKOFF_MAX_S = 5.0


class BatchGenClient:
    """A client of ``batchgen serve``.

    Args:
        endpoint: the server's base URL, e.g. ``"http://127.0.0.1:8000"``.
        api_key: sent as ``Authorization: Bearer <key>``; default ``$BATCHGEN_API_KEY``.
        timeout: seconds per HTTP request (connect, read, write).
        retry_timeout: how long to keep retrying an unreachable server (seconds) before
            raising `BatchGenError`.
    """

    def __init__(
        self,
        endpoint: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float = 60.0,
        retry_timeout: float = 120.0,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        key = api_key if api_key is not None else os.environ.get("BATCHGEN_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.endpoint, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BatchGenClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- batches ------------------------------------------------------------------------
    def submit_batch(
        self,
        prompts: Sequence[str | list[int] | list[dict[str, Any]]],
        max_tokens: int | None = None,
        temperature: float | None = None,
        *,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        **sampling: Any,
    ) -> BatchJob:
        """Submit prompts as one batch; request ``i`` has custom_id ``prompt-<i>``.

        Args:
            prompts: completion prompts (strings or token-id lists), or chat conversations
                (lists of ``{"role", "content"}``); not both kinds in one batch.
            max_tokens / temperature: None keeps the endpoint's default (completions: 16
                tokens; temperature 1).
            sampling: other body fields (``top_p``, ``n``, ``stop``, ``seed``, ``top_k``...).

        Raises:
            ValueError: no prompts, or completion prompts mixed with conversations.
            BatchGenError: the server refused the file or the batch.
        """
        if not prompts:
            raise ValueError("prompts is empty")
        is_chat = [_is_conversation(p) for p in prompts]
        if any(is_chat) and not all(is_chat):
            raise ValueError("mix of completion prompts and chat conversations in one batch")
        url = CHAT_COMPLETIONS_URL if is_chat[0] else COMPLETIONS_URL
        fields = dict(sampling)
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        if temperature is not None:
            fields["temperature"] = temperature
        lines = []
        for i, prompt in enumerate(prompts):
            body = {"messages" if is_chat[0] else "prompt": prompt, **fields}
            line = {"custom_id": f"prompt-{i}", "method": "POST", "url": url, "body": body}
            lines.append(json.dumps(line, ensure_ascii=False))
        data = ("\n".join(lines) + "\n").encode("utf-8")
        file = self.upload_file(data, filename="prompts.jsonl")
        return self.create_batch(file["id"], url, completion_window, metadata)

    def submit_file(
        self,
        path: str | os.PathLike,
        *,
        endpoint: str | None = None,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> BatchJob:
        """Upload an OpenAI Batch input file (JSONL) and start a batch on it.

        A batch has one endpoint, as in the OpenAI Batch API: a line whose ``url`` is another
        endpoint fails alone. `submit_file_by_endpoint` starts one batch per endpoint instead.

        Args:
            endpoint: the batch's endpoint; default: the endpoint of the file's lines (a
                line's ``url``, else ``/v1/chat/completions`` for a line with ``messages``,
                else ``/v1/completions``).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: ``endpoint`` is None and the lines name more than one endpoint (the
                message counts the lines of each).
            BatchGenError: the server refused the file or the batch.
        """
        path = Path(path)
        if endpoint is None:
            groups = split_by_endpoint(path)
            if len(groups) > 1:
                counts = ", ".join(f"{url} ({g.num_lines} lines)" for url, g in groups.items())
                raise ValueError(
                    f"{str(path)!r} mixes endpoints: {counts}; a batch has one endpoint. Pass "
                    "endpoint=..., or use submit_file_by_endpoint (one batch per endpoint)"
                )
            endpoint = next(iter(groups), COMPLETIONS_URL)
        file = self.upload_file(path)
        return self.create_batch(file["id"], endpoint, completion_window, metadata)

    def submit_file_by_endpoint(
        self,
        path: str | os.PathLike,
        *,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> list[BatchJob]:
        """Start one batch per endpoint that the lines of ``path`` name (see
        `split_by_endpoint`), so a file that `batchgen run` takes whole (completions and chat
        lines mixed) runs whole on the server too. Each batch's input keeps the file's line
        numbers (other endpoints' lines are blanked), so a line's error names the same line as
        `batchgen run` would. A file of one endpoint gives one batch, as `submit_file`.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            BatchGenError: the server refused a file or a batch (batches already started keep
                running).
        """
        path = Path(path)
        groups = split_by_endpoint(path)
        if len(groups) <= 1:
            endpoint = next(iter(groups), COMPLETIONS_URL)
            return [
                self.submit_file(
                    path, endpoint=endpoint, completion_window=completion_window, metadata=metadata
                )
            ]
        jobs = []
        for url, group in groups.items():
            file = self.upload_file(group.data, filename=path.name)
            jobs.append(self.create_batch(file["id"], url, completion_window, metadata))
        return jobs

    def upload_file(self, source: str | os.PathLike | bytes, filename: str | None = None) -> dict:
        """Upload a batch input file (a path, or its bytes); returns the ``file`` object."""
        if isinstance(source, bytes):
            name = filename or "batch.jsonl"

            def files() -> dict:
                return {"file": (name, source, "application/jsonl")}
        else:
            path = Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"{str(path)!r} is not a file")
            name = filename or path.name

            def files() -> dict:
                return {"file": (name, open(path, "rb"), "application/jsonl")}

        response = self._request(
            "POST", "/v1/files", idempotent=False, files=files, data={"purpose": "batch"}
        )
        return response.json()

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> BatchJob:
        """Start a batch on an uploaded file; returns its `BatchJob`."""
        body: dict[str, Any] = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
        }
        if metadata is not None:
            body["metadata"] = metadata
        response = self._request("POST", "/v1/batches", idempotent=False, json=body)
        return BatchJob(self, response.json())

    def batch(self, batch_id: str) -> BatchJob:
        """Re-attach to an existing batch. Raises `BatchGenError` (404) when unknown."""
        return BatchJob(self, self._request("GET", f"/v1/batches/{batch_id}").json())

    def list_batches(self, limit: int = 20, after: str | None = None) -> list[dict[str, Any]]:
        """Batch objects, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        return self._request("GET", "/v1/batches", params=params).json()["data"]

    def download(self, file_id: str) -> bytes:
        """The content of a file (e.g. a batch's ``output_file_id``)."""
        return self._request("GET", f"/v1/files/{file_id}/content").content

    # ---- HTTP with retries --------------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        *,
        idempotent: bool = True,
        files: Callable[[], dict] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send a request, retrying connection failures (and 502/503/504 for idempotent
        requests) with exponential backoff until ``retry_timeout``.

        Raises:
            BatchGenError: an error status, or the server stayed unreachable.
        """
        deadline = time.monotonic() + self.retry_timeout
        delay = _BACKOFF_START_S
        while True:
            try:
                if files is not None:
                    kwargs["files"] = files()
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as err:
                # Once a request was sent, only a read may safely be sent again.
                unsent = isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout))
                if not (idempotent or unsent) or time.monotonic() + delay > deadline:
                    raise BatchGenError(
                        f"cannot reach {self.endpoint} ({type(err).__name__}: {err})"
                    ) from err
                logger.info("%s %s: %s; retrying in %.1f s", method, path, err, delay)
            else:
                retry = idempotent and response.status_code in _RETRY_STATUSES
                if not retry or time.monotonic() + delay > deadline:
                    return _checked(response)
            finally:
                _close_files(kwargs.get("files"))
            time.sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, _BACKOFF_MAX_S)


def _close_files(files: dict | None) -> None:
    for value in (files or {}).values():
        handle = value[1] if isinstance(value, tuple) else value
        if hasattr(handle, "close"):
            handle.close()


def _checked(response: httpx.Response) -> httpx.Response:
    if response.status_code < 400:
        return response
    try:
        error = response.json()["error"]
        message = error.get("message") or response.reason_phrase
    except (ValueError, KeyError, TypeError, AttributeError):
        error, message = {}, f"HTTP {response.status_code}: {response.text[:200]}"
    raise BatchGenError(
        message,
        status_code=response.status_code,
        code=error.get("code"),
        param=error.get("param"),
        type=error.get("type"),
    )


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
