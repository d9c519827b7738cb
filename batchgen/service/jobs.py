"""Batch life cycle work off the engine thread: validating an input file into request rows, and
finalizing a batch into its output and error files. One background thread, one job at a time.

Validation reads the input file line by line (never whole) and stores one row per non-blank
line: a ``pending`` request, or, for a line that cannot run, its error line right away (blank
lines between requests are skipped with a warning naming them; trailing ones silently). Per-line
errors are `batchgen run`'s (invalid JSON, missing custom_id, unknown url, bad fields,
``stream: true``...) plus two batch-level ones: a duplicate ``custom_id`` (the first occurrence
runs, later ones get ``duplicate_custom_id``) and a ``url`` other than the batch's ``endpoint``
(``invalid_url``). The rest of the file still runs. A file with no request line, or one that
cannot be read, fails the batch (``errors`` says why).

Finalizing writes every stored result into the output file (successes) or the error file
(failures), in input order. A cancelled or expired batch first gets an error line for each
request that did not finish (codes ``batch_cancelled`` / ``batch_expired``), so every
``custom_id`` of the input appears exactly once across the two files.

After a restart, `JobWorker.recover` redoes the work of batches caught in ``validating``,
``finalizing`` or ``cancelling``; every step is idempotent.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from batchgen.entrypoints.openai_protocol import (
    INVALID_URL,
    BatchLineError,
    BlankLines,
    dumps_line,
    duplicate_custom_id_line,
    error_line,
    error_line_from,
    parse_batch_line,
)
from batchgen.service import store as st

logger = logging.getLogger(__name__)

BATCH_CANCELLED = "batch_cancelled"
BATCH_EXPIRED = "batch_expired"
_INSERT_CHUNK = 2000
_NOT_FINAL = (st.VALIDATING, st.IN_PROGRESS, st.FINALIZING, st.CANCELLING)
_UNFINISHED_CODES = {
    st.CANCELLED: (BATCH_CANCELLED, "the batch was cancelled before this request ran"),
    st.EXPIRED: (BATCH_EXPIRED, "the batch expired before this request ran"),
}


class _LineValidator:
    """Turns input lines into `InputRow`s, tracking custom_ids for duplicates."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.seen: dict[str, int] = {}  # custom_id -> 1-based line of its first use

    def row(self, idx: int, line: int, raw: bytes) -> st.InputRow:
        try:
            request = parse_batch_line(raw, line)
        except BatchLineError as err:
            if err.custom_id is not None:
                first_line = self.seen.setdefault(err.custom_id, line)
                if first_line != line:
                    return self._duplicate(idx, line, err.custom_id, first_line)
            return st.InputRow(idx, line, err.custom_id, None, dumps_line(error_line_from(err)))
        custom_id = request.custom_id
        first_line = self.seen.setdefault(custom_id, line)
        if first_line != line:
            return self._duplicate(idx, line, custom_id, first_line)
        if request.request.url != self.endpoint:
            message = (
                f"line {line}: 'url' {request.request.url!r} does not match the batch's "
                f"endpoint {self.endpoint!r}"
            )
            result = error_line(custom_id, INVALID_URL, message, param="url", line=line)
            return st.InputRow(idx, line, custom_id, None, dumps_line(result))
        text = raw.decode("utf-8").rstrip("\r\n")
        return st.InputRow(idx, line, custom_id, text, None)

    @staticmethod
    def _duplicate(idx: int, line: int, custom_id: str, first_line: int) -> st.InputRow:
        result = duplicate_custom_id_line(custom_id, line, first_line)
        return st.InputRow(idx, line, custom_id, None, dumps_line(result))


class JobWorker:
    """Validates and finalizes batches on one background thread.

    Args:
        store: the job store.
        on_ready: called with a batch id once it is ``in_progress`` (hand it to the engine).
        on_change: called with ``{batch_id}`` when a batch reaches a final status; must be
            thread-safe.
    """

    def __init__(
        self,
        store: st.Store,
        *,
        on_ready: Callable[[str], None],
        on_change: Callable[[set[str]], None],
    ) -> None:
        self.store = store
        self._on_ready = on_ready
        self._on_change = on_change
        self._jobs: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchgen-jobs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current job; queued jobs are left to `recover` on the next start."""
        self._stopping.set()
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def validate(self, batch_id: str) -> None:
        self._jobs.put(("validate", batch_id, None))

    def finalize(self, batch_id: str, final_status: str) -> None:
        """Queue the finalization of a batch into ``final_status`` (completed, cancelled or
        expired)."""
        self._jobs.put(("finalize", batch_id, final_status))

    def recover(self) -> None:
        """Queue the jobs that a previous process left unfinished (call before `start`)."""
        for batch in self.store.batches_with_status(st.VALIDATING):
            self.validate(batch["id"])
        for batch in self.store.batches_with_status(st.FINALIZING):
            self.finalize(batch["id"], st.COMPLETED)
        for batch in self.store.batches_with_status(st.CANCELLING):
            # Cancelled while validating: validation still has to list its requests.
            if batch["in_progress_at"] is None:
                self.validate(batch["id"])
            else:
                self.finalize(batch["id"], st.CANCELLED)

    def _run(self) -> None:
        while not self._stopping.is_set():
            job = self._jobs.get()
            if job is None or self._stopping.is_set():
                return
            kind, batch_id, final_status = job
            try:
                if kind == "validate":
                    self._validate(batch_id)
                else:
                    self._finalize(batch_id, final_status)
            except Exception as exc:
                logger.exception("batch %s: %s failed", batch_id, kind)
                reason = f"{kind} failed on the server ({type(exc).__name__})"
                self._fail(batch_id, "internal_error", reason, expect=_NOT_FINAL)

    # ---- validation ---------------------------------------------------------------------
    def _validate(self, batch_id: str) -> None:
        batch = self.store.get_batch(batch_id)
        if batch is None or batch["status"] not in (st.VALIDATING, st.CANCELLING):
            return
        self.store.reset_requests(batch_id)
        file_id = batch["input_file_id"]
        try:
            if self.store.get_file(file_id) is None:
                raise FileNotFoundError(file_id)
            count = self._insert_rows(batch_id, file_id, batch["endpoint"])
        except FileNotFoundError:
            self._fail(batch_id, "invalid_input_file", f"input file {file_id!r} was deleted")
            return
        if count == 0:
            self._fail(batch_id, "empty_file", "the input file has no request line")
            return
        if self.store.transition(batch_id, st.IN_PROGRESS, expect=[st.VALIDATING]):
            logger.info("batch %s validated: %d requests", batch_id, count)
            self._on_ready(batch_id)
        else:  # cancelled while validating
            self._finalize(batch_id, st.CANCELLED)

    def _insert_rows(self, batch_id: str, file_id: str, endpoint: str) -> int:
        validator = _LineValidator(endpoint)
        blank = BlankLines()
        rows: list[st.InputRow] = []
        idx = 0
        with open(self.store.blob_path(file_id), "rb") as f:
            for line, raw in enumerate(f, start=1):
                if blank.skip(line, raw):
                    continue
                rows.append(validator.row(idx, line, raw))
                idx += 1
                if len(rows) >= _INSERT_CHUNK:
                    self.store.insert_requests(batch_id, rows)
                    rows = []
        if rows:
            self.store.insert_requests(batch_id, rows)
        if blank.count:
            logger.warning(
                "batch %s: input file %s: skipped %s between requests",
                batch_id,
                file_id,
                blank.describe(),
            )
        return idx

    def _fail(
        self,
        batch_id: str,
        code: str,
        message: str,
        expect: tuple[str, ...] = (st.VALIDATING, st.CANCELLING),
    ) -> None:
        errors = {
            "object": "list",
            "data": [{"code": code, "message": message, "param": None, "line": None}],
        }
        if self.store.transition(batch_id, st.FAILED, expect=expect, errors=errors):
            logger.info("batch %s failed: %s", batch_id, message)
        self._on_change({batch_id})

    # ---- finalization -------------------------------------------------------------------
    def _finalize(self, batch_id: str, final_status: str) -> None:
        if final_status == st.COMPLETED:
            expect = [st.FINALIZING]
        elif final_status == st.CANCELLED:
            expect = [st.CANCELLING]
        else:
            expect = [st.IN_PROGRESS]
        batch = self.store.get_batch(batch_id)
        if batch is None or batch["status"] not in expect:
            return
        if final_status in _UNFINISHED_CODES:
            code, why = _UNFINISHED_CODES[final_status]

            def make_line(custom_id: str | None, line: int) -> str:
                return dumps_line(error_line(custom_id, code, f"line {line}: {why}", line=line))

            self.store.fail_pending(batch_id, make_line)
        if self.store.finish_batch(batch_id, final_status, expect):
            logger.info("batch %s %s", batch_id, final_status)
        self._on_change({batch_id})
