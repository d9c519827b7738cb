"""What `BatchGenClient` hands back: `BatchJob` (a batch on the server: status, wait, cancel,
its results streamed as the server stores them), `BatchResult` (one result line) and
`BatchGenError` (an error answered by the server, or an unreachable server).

Built on ``httpx`` only (no torch import), like `batchgen.service.client`, which re-exports
every name here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.service.client import BatchGenClient

TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "expired"})


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
