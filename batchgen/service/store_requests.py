"""The request rows of the job store: validated input lines, the pending requests the engine
loop reads, the per-step commit of results (`RequestRows.commit_progress`) and the batch output
and error files written from the results (`RequestRows.finish_batch`).

`RequestRows` is a mixin of `batchgen.service.store.Store`: it uses the store's connections
(``_conn``, ``_write``) and blobs (``_write_blob``, ``blob_path``) and keeps the durability rules
stated in that module's docstring (one transaction per engine step, a result is never
overwritten).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterable, Iterator
from typing import Any

from batchgen.service.store_schema import (
    COPY_CHUNK,
    PENDING,
    REQUEST_FAILED,
    STATUS_TIME,
    SUCCEEDED,
    FinishedRequest,
    InputRow,
    PendingRequest,
    StoredResult,
    new_file_id,
)


class RequestRows:
    """Request-row methods of `Store` (a mixin: it holds no state of its own)."""

    def reset_requests(self, batch_id: str) -> None:
        """Forget a batch's request rows and counters (validation starts over)."""
        with self._write() as conn:
            conn.execute("DELETE FROM requests WHERE batch_id = ?", (batch_id,))
            conn.execute(
                "UPDATE batches SET total = 0, completed = 0, failed = 0, prompt_tokens = 0, "
                "completion_tokens = 0 WHERE id = ?",
                (batch_id,),
            )

    def insert_requests(self, batch_id: str, rows: list[InputRow]) -> None:
        """Add validated input rows (one transaction); failed rows count as failed results."""
        with self._write() as conn:
            seq = self._max_done_seq(conn, batch_id)
            values = []
            failed = 0
            now = time.time()
            for r in rows:
                if r.result is None:
                    values.append((batch_id, r.idx, r.line, r.custom_id, r.input, PENDING))
                    values[-1] += (None, None, None)
                else:
                    seq += 1
                    failed += 1
                    values.append(
                        (batch_id, r.idx, r.line, r.custom_id, None, REQUEST_FAILED)
                        + (r.result, seq, now)
                    )
            conn.executemany(
                "INSERT INTO requests (batch_id, idx, line, custom_id, input, state, result, "
                "done_seq, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                values,
            )
            conn.execute(
                "UPDATE batches SET total = total + ?, failed = failed + ? WHERE id = ?",
                (len(rows), failed, batch_id),
            )

    @staticmethod
    def _max_done_seq(conn: sqlite3.Connection, batch_id: str) -> int:
        row = conn.execute(
            "SELECT MAX(done_seq) FROM requests WHERE batch_id = ? AND done_seq IS NOT NULL",
            (batch_id,),
        ).fetchone()
        return row[0] or 0

    def pending_requests(self, batch_id: str, after_idx: int, limit: int) -> list[PendingRequest]:
        """Up to ``limit`` pending requests of a batch with index > ``after_idx``, by index."""
        rows = self._conn().execute(
            "SELECT idx, line, input FROM requests WHERE batch_id = ? AND idx > ? "
            "AND state = ? ORDER BY idx LIMIT ?",
            (batch_id, after_idx, PENDING, limit),
        )
        return [PendingRequest(batch_id, r["idx"], r["line"], r["input"]) for r in rows]

    def count_pending(self, batch_id: str) -> int:
        row = (
            self._conn()
            .execute(
                "SELECT COUNT(*) FROM requests WHERE batch_id = ? AND state = ?",
                (batch_id, PENDING),
            )
            .fetchone()
        )
        return row[0]

    def commit_progress(
        self, started: list[tuple[str, int]], finished: list[FinishedRequest]
    ) -> None:
        """One transaction: count an attempt for each started ``(batch_id, idx)``, store each
        finished request's result (only if still pending: a result is never overwritten) and
        update the batches' counters."""
        if not started and not finished:
            return
        with self._write() as conn:
            conn.executemany(
                "UPDATE requests SET attempts = attempts + 1 WHERE batch_id = ? AND idx = ?",
                started,
            )
            next_seq: dict[str, int] = {}
            now = time.time()
            for f in finished:
                if f.batch_id not in next_seq:
                    next_seq[f.batch_id] = self._max_done_seq(conn, f.batch_id)
                seq = next_seq[f.batch_id] + 1
                updated = conn.execute(
                    "UPDATE requests SET state = ?, result = ?, input = NULL, done_seq = ?, "
                    "finished_at = ? WHERE batch_id = ? AND idx = ? AND state = ?",
                    (
                        SUCCEEDED if f.ok else REQUEST_FAILED,
                        f.result,
                        seq,
                        now,
                        f.batch_id,
                        f.idx,
                        PENDING,
                    ),
                ).rowcount
                if not updated:
                    continue
                next_seq[f.batch_id] = seq
                conn.execute(
                    "UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                    "prompt_tokens = prompt_tokens + ?, completion_tokens = completion_tokens + ? "
                    "WHERE id = ?",
                    (
                        int(f.ok),
                        int(not f.ok),
                        f.prompt_tokens,
                        f.completion_tokens,
                        f.batch_id,
                    ),
                )

    def fail_pending(self, batch_id: str, make_line: Any) -> int:
        """Give every still-pending request of a batch an error result (cancel / expiry).

        ``make_line(custom_id, line) -> str`` builds each error output line. Returns how many
        requests were failed.
        """
        with self._write() as conn:
            rows = conn.execute(
                "SELECT idx, line, custom_id FROM requests WHERE batch_id = ? AND state = ? "
                "ORDER BY idx",
                (batch_id, PENDING),
            ).fetchall()
            seq = self._max_done_seq(conn, batch_id)
            now = time.time()
            updates = []
            for r in rows:
                seq += 1
                updates.append(
                    (REQUEST_FAILED, make_line(r["custom_id"], r["line"]), seq, now)
                    + (batch_id, r["idx"])
                )
            conn.executemany(
                "UPDATE requests SET state = ?, result = ?, input = NULL, done_seq = ?, "
                "finished_at = ? WHERE batch_id = ? AND idx = ?",
                updates,
            )
            conn.execute(
                "UPDATE batches SET failed = failed + ? WHERE id = ?", (len(rows), batch_id)
            )
        return len(rows)

    def results_after(self, batch_id: str, after_seq: int, limit: int) -> list[StoredResult]:
        """Stored results with ``done_seq`` > ``after_seq``, in storing order."""
        rows = self._conn().execute(
            "SELECT done_seq, idx, line, custom_id, result FROM requests WHERE batch_id = ? "
            "AND done_seq > ? ORDER BY done_seq LIMIT ?",
            (batch_id, after_seq, limit),
        )
        return [
            StoredResult(r["done_seq"], r["idx"], r["line"], r["custom_id"], r["result"])
            for r in rows
        ]

    def _result_chunks(self, batch_id: str, state: str) -> Iterator[bytes]:
        """Result lines of a batch in one state, by input index, as ~1 MiB chunks of JSONL."""
        cursor = self._conn().execute(
            "SELECT result FROM requests WHERE batch_id = ? AND state = ? ORDER BY idx",
            (batch_id, state),
        )
        parts, size = [], 0
        for (result,) in cursor:
            data = result.encode("utf-8") + b"\n"
            parts.append(data)
            size += len(data)
            if size >= COPY_CHUNK:
                yield b"".join(parts)
                parts, size = [], 0
        if parts:
            yield b"".join(parts)

    def request_attempts(self, batch_id: str) -> dict[int, int]:
        """``{idx: attempts}`` of a batch (how often each request was handed to the engine)."""
        rows = self._conn().execute(
            "SELECT idx, attempts FROM requests WHERE batch_id = ?", (batch_id,)
        )
        return {r["idx"]: r["attempts"] for r in rows}

    def finish_batch(self, batch_id: str, status: str, expect: Iterable[str]) -> bool:
        """Write the batch's output file (successes) and error file (failures), each in input
        order, and move the batch to its final ``status`` in the same transaction that
        registers the files. A kind with no line gets no file (its id stays null).

        Returns:
            False when the batch was not in one of the ``expect`` statuses (nothing is
            registered; the blobs just written are removed).
        """
        rows, ids = [], {}
        now = int(time.time())
        for kind, state in (("output", SUCCEEDED), ("error", REQUEST_FAILED)):
            file_id = new_file_id()
            size = self._write_blob(file_id, self._result_chunks(batch_id, state))
            if size == 0:
                self.blob_path(file_id).unlink()
                continue
            ids[f"{kind}_file_id"] = file_id
            rows.append((file_id, f"{batch_id}_{kind}.jsonl", "batch_output", size, now))
        expect = list(expect)
        with self._write() as conn:
            current = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,))
            row = current.fetchone()
            ok = row is not None and row[0] in expect
            if ok:
                conn.executemany(
                    "INSERT INTO files (id, filename, purpose, bytes, created_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    rows,
                )
                sets = {"status": status, STATUS_TIME[status]: now, **ids}
                conn.execute(
                    "UPDATE batches SET " + ", ".join(f"{k} = ?" for k in sets) + " WHERE id = ?",
                    (*sets.values(), batch_id),
                )
        if not ok:
            for file_id in ids.values():
                with contextlib.suppress(OSError):
                    self.blob_path(file_id).unlink()
        return ok
