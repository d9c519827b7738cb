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
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
SUPPORTED_URLS = (COMPLETIONS_URL, CHAT_COMPLETIONS_URL)
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "expired"})
_RETRY_STATUSES = frozenset({502, 503, 504})
_BACKOFF_START_S = 0.2
_BACKOFF_MAX_S = 5.0


class BatchGenError(Exception):
    """An error answered by the server (HTTP 4xx/5xx), or the server stayed unreachable.

    Attributes:
        status_code: the HTTP status, or None when the server could not be reached.
        code / param / type: the OpenAI error object's fields (None when absent).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.param = param
        self.type = type


@dataclass(frozen=True)
class BatchResult:
    """One result of a batch, as stored by the server.

    Attributes:
        index: 0-based position of the request among the input's non-blank lines (for
            `BatchGenClient.submit_batch`: the index of the prompt).
        custom_id: the request's custom_id (None for an input line that had none).
        line: 1-based line number in the input file.
        result: the batch output line ``{"id", "custom_id", "response", "error"}``.
    """

    index: int
    custom_id: str | None
    line: int
    result: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.result.get("error") is None

    @property
    def body(self) -> dict[str, Any] | None:
        """The ``text_completion`` / ``chat.completion`` object, None for an error."""
        response = self.result.get("response")
        if not self.ok or not response:
            return None
        return response.get("body")

    @property
    def error(self) -> dict[str, Any] | None:
        """``{"code", "message", "param", "line"}`` for a failed request, else None."""
        return self.result.get("error")

    @property
    def text(self) -> str | None:
        """The first choice's text (completions) or message content (chat); None on error."""
        body = self.body
        if not body or not body.get("choices"):
            return None
        choice = body["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice.get("text")


class BatchJob:
    """A batch on the server (returned by the submit methods, or `BatchGenClient.batch`)."""

    def __init__(self, client: BatchGenClient, batch: dict[str, Any]) -> None:
        self.client = client
        self.id: str = batch["id"]
        self.batch = batch

    def __repr__(self) -> str:
        return f"BatchJob(id={self.id!r}, status={self.batch.get('status')!r})"

    def refresh(self) -> dict[str, Any]:
        """Fetch the batch object (OpenAI's ``batch``) and keep it in ``self.batch``."""
        self.batch = self.client._request("GET", f"/v1/batches/{self.id}").json()
        return self.batch

    def status(self) -> str:
        """The current status: validating, in_progress, finalizing, completed, failed,
        cancelling, cancelled or expired."""
        return self.refresh()["status"]

    def wait(self, *, poll_interval: float = 1.0, timeout: float | None = None) -> dict[str, Any]:
        """Poll until the batch reaches a final status; returns the batch object.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.refresh()["status"] not in TERMINAL_STATUSES:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"batch {self.id} is still {self.batch['status']}")
            time.sleep(poll_interval)
        return self.batch

    def cancel(self) -> dict[str, Any]:
        """Ask the server to cancel; returns the batch object (status ``cancelling``, later
        ``cancelled``). Raises `BatchGenError` (409) when the batch already finished."""
        self.batch = self.client._request("POST", f"/v1/batches/{self.id}/cancel").json()
        return self.batch

    def iter_results(self, *, poll_wait: float = 10.0) -> Iterator[BatchResult]:
        """Yield every result of the batch once, as soon as the server has stored it.

        Results come in the order they were stored (not input order); each carries its
        ``index`` and ``custom_id``. Ends when the batch has reached a final status and every
        result was yielded; for a cancelled or expired batch that includes the error results
        of the requests that never ran. Survives server restarts (see the module docstring).

        Args:
            poll_wait: seconds the server holds a poll open waiting for new results (1-30).
        """
        wait = max(1, min(30, int(poll_wait)))
        after = 0
        while True:
            page = self.client._request(
                "GET",
                f"/v1/batches/{self.id}/results",
                params={"after": after, "wait": wait},
                timeout=self.client.timeout + wait,
            ).json()
            for item in page["data"]:
                yield BatchResult(item["index"], item["custom_id"], item["line"], item["result"])
            after = page["last_seq"]
            if page["complete"]:
                return

    def results(self) -> list[BatchResult]:
        """Every result, in input order (waits for the batch to finish)."""
        return sorted(self.iter_results(), key=lambda r: r.index)


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


@dataclass
class EndpointLines:
    """The lines of a batch input file that go to one endpoint (`split_by_endpoint`).

    Attributes:
        data: the file's bytes with every other endpoint's line blanked (an empty line), so
            line numbers stay those of the file.
        num_lines: how many lines (not blank) go to this endpoint.
    """

    data: bytes
    num_lines: int


def line_endpoint(raw: bytes) -> str | None:
    """The endpoint of one batch input line: its ``url`` when a string, else
    ``/v1/chat/completions`` for a line with ``messages``, else ``/v1/completions``; None for
    a line that is not a JSON object (the server reports its error)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("url"), str):
        return obj["url"]
    return CHAT_COMPLETIONS_URL if "messages" in obj else COMPLETIONS_URL


def split_by_endpoint(path: str | os.PathLike) -> dict[str, EndpointLines]:
    """Group the lines of a batch input file by endpoint (`line_endpoint`), in order of first
    appearance. A line with no endpoint (not JSON) or with one BatchGen does not serve (say
    ``/v1/embeddings``) goes with the first served endpoint, whose batch reports its error
    line (``invalid_url`` for the latter, as ``batchgen run`` does) while the rest runs; a file
    of such lines only goes to ``/v1/completions``. Blank lines are kept in every group (the
    server skips them)."""
    lines = Path(path).read_bytes().splitlines(keepends=True)
    ends = [None if not raw.strip() else line_endpoint(raw) for raw in lines]
    ends = [e if e in SUPPORTED_URLS else None for e in ends]
    urls = list(dict.fromkeys(e for e in ends if e is not None))
    if not urls and any(raw.strip() for raw in lines):
        urls = [COMPLETIONS_URL]
    # Each non-blank line's batch: its own endpoint, or the first one for a line without.
    owners = [None if not raw.strip() else (e or urls[0]) for raw, e in zip(lines, ends)]
    groups = {}
    for url in urls:
        keep = [raw if owner in (None, url) else b"\n" for raw, owner in zip(lines, owners)]
        groups[url] = EndpointLines(b"".join(keep), owners.count(url))
    return groups
