"""The durable job store: SQLite (WAL) for files, batches and per-request results, plus blob
files under ``<state_dir>/files/``.

Layout of ``state_dir``::

    batchgen.sqlite3 (+ -wal, -shm)   the tables below
    files/<file_id>                    file contents (uploads, batch output/error files)

Durability rules:

* Blobs are written to a temporary name, fsync'ed, renamed to their id and the directory is
  fsync'ed; only then is the ``files`` row committed. A crash leaves at worst an orphan blob or
  temporary file, which `Store.__init__` removes.
* Every finished request is committed (state, result line, counters) in one transaction with
  the other results of the same engine step. WAL with ``synchronous=NORMAL`` makes a commit
  survive the death of the process (SIGKILL); an OS crash or power loss may roll back the last
  commits, whose requests then simply run again (they are still ``pending``).
* File ids are opaque (``file-<32 hex>``); a blob's path is derived from an id only after the id
  was found in the ``files`` table, so no client string ever becomes a path.

Confidentiality: inputs and results are readable by this user only. The directories are created
0700 and every file 0600 (the database before SQLite opens it: SQLite gives its ``-wal`` and
``-shm`` files the database's mode); a state directory written by an older version (0755, files
0644) is tightened when opened.

Thread safety: each thread gets its own connection; writes are serialised by one in-process
lock (``BEGIN IMMEDIATE``), so SQLite never answers "database is locked" to our own writers.
Readers never block (WAL).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

DB_NAME = "batchgen.sqlite3"
BLOB_DIR = "files"
SCHEMA_VERSION = 1
_COPY_CHUNK = 1 << 20

FILE_ID_RE = re.compile(r"^file-[0-9a-f]{32}$")
BATCH_ID_RE = re.compile(r"^batch_[0-9a-f]{32}$")

# Batch statuses (OpenAI's).
VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
FAILED = "failed"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
EXPIRED = "expired"
TERMINAL_STATUSES = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})
# The timestamp column set when a batch enters each status.
_STATUS_TIME = {
    IN_PROGRESS: "in_progress_at",
    FINALIZING: "finalizing_at",
    COMPLETED: "completed_at",
    FAILED: "failed_at",
    CANCELLING: "cancelling_at",
    CANCELLED: "cancelled_at",
    EXPIRED: "expired_at",
}

# Request states. ``pending`` rows still have to run; all others hold their output line.
PENDING = "pending"
SUCCEEDED = "succeeded"
REQUEST_FAILED = "failed"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,          -- 0-based index among the input file's non-blank lines
    line INTEGER NOT NULL,         -- 1-based line number in the input file
    custom_id TEXT,
    input TEXT,                    -- the raw input line while pending, NULL once done
    state TEXT NOT NULL,           -- pending | succeeded | failed
    result TEXT,                   -- the output line (JSON) once done
    done_seq INTEGER,              -- 1, 2, ... in the order results were stored (per batch)
    attempts INTEGER NOT NULL DEFAULT 0,  -- times the request was handed to the engine
    finished_at REAL,
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS requests_by_done_seq ON requests (batch_id, done_seq)
    WHERE done_seq IS NOT NULL;
"""


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class InputRow:
    """One non-blank input line of a batch, as validation stores it.

    ``result`` is None for a request to run (state ``pending``, ``input`` the raw line) and
    the error output line for a line that failed validation (state ``failed``).
    """

    idx: int
    line: int
    custom_id: str | None
    input: str | None
    result: str | None


@dataclass(frozen=True)
class PendingRequest:
    """A request still to run: its batch, index, 1-based line number and raw input line."""

    batch_id: str
    idx: int
    line: int
    input: str


@dataclass(frozen=True)
class FinishedRequest:
    """The outcome of one batch request, ready to commit.

    Attributes:
        batch_id / idx: which request.
        ok: True for a success line, False for an error line.
        result: the output line (JSON text, no newline).
        prompt_tokens / completion_tokens: usage of a success (0 for errors).
    """

    batch_id: str
    idx: int
    ok: bool
    result: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class StoredResult:
    """A stored result as `Store.results_after` returns it."""

    done_seq: int
    idx: int
    line: int
    custom_id: str | None
    result: str


def _make_private(state_dir: Path, blob_dir: Path, db_path: Path) -> None:
    """Create the state and blob directories (0700) and the database file (0600), and tighten
    what an older version left readable by others."""
    ours = db_path.exists() or not state_dir.exists()
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    blob_dir.mkdir(mode=0o700, exist_ok=True)
    os.close(os.open(db_path, os.O_RDWR | os.O_CREAT, 0o600))
    # The state directory itself only when it is ours: --state-dir may name a shared folder.
    dirs = [state_dir, blob_dir] if ours else [blob_dir]
    files = [p for p in state_dir.glob(DB_NAME + "*") if p.is_file()]
    files += [p for p in blob_dir.iterdir() if p.is_file()]
    for path, mode in [(d, 0o700) for d in dirs] + [(f, 0o600) for f in files]:
        with contextlib.suppress(OSError):  # not our file, or a filesystem without modes
            if path.stat().st_mode & 0o077:
                path.chmod(mode)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every platform / filesystem
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Store:
    """SQLite + blob store under ``state_dir`` (created when missing).

    Raises:
        OSError: ``state_dir`` cannot be created or written.
        sqlite3.DatabaseError: the database file is corrupt or not a BatchGen store.
    """

    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.state_dir = Path(state_dir)
        self.blob_dir = self.state_dir / BLOB_DIR
        self.db_path = self.state_dir / DB_NAME
        _make_private(self.state_dir, self.blob_dir, self.db_path)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self._write_lock = threading.RLock()
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise sqlite3.DatabaseError(
                f"{self.db_path} has schema version {version}; this BatchGen reads "
                f"version {SCHEMA_VERSION}"
            )
        with self._write() as c:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    c.execute(statement)
            c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self._remove_orphan_blobs()

    # ---- connections ------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(
                self.db_path, timeout=60.0, isolation_level=None, check_same_thread=False
            )
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=60000")
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, serialised with every other writer of this process."""
        with self._write_lock:
            conn = self._conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def close(self) -> None:
        """Close every connection (call once no thread uses the store any more)."""
        with self._connections_lock:
            for conn in self._connections:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._connections.clear()
        self._local = threading.local()

    # ---- blobs --------------------------------------------------------------------------
    def blob_path(self, file_id: str) -> Path:
        """Path of a stored file's blob. Raises ValueError for a malformed id."""
        if not FILE_ID_RE.match(file_id):
            raise ValueError(f"malformed file id {file_id!r}")
        return self.blob_dir / file_id

    def _write_blob(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """Write a blob atomically (temporary file, fsync, rename); returns its size in bytes."""
        tmp = self.blob_dir / f".tmp-{uuid.uuid4().hex}"
        size = 0
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.blob_path(file_id))
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(self.blob_dir)
        return size

    def _remove_orphan_blobs(self) -> None:
        known = {row["id"] for row in self._conn().execute("SELECT id FROM files")}
        for path in self.blob_dir.iterdir():
            if path.name.startswith(".tmp-") or (
                FILE_ID_RE.match(path.name) and path.name not in known
            ):
                with contextlib.suppress(OSError):
                    path.unlink()

    # ---- files --------------------------------------------------------------------------
    def create_file(self, source: BinaryIO | Iterable[bytes], filename: str, purpose: str) -> dict:
        """Store a file and return its row (``id``, ``filename``, ``purpose``, ``bytes``,
        ``created_at`` in Unix seconds). ``source``: a binary file object read to its end, or
        an iterable of byte chunks."""
        file_id = new_file_id()
        if hasattr(source, "read"):
            chunks: Iterable[bytes] = iter(lambda: source.read(_COPY_CHUNK), b"")  # type: ignore[union-attr]
        else:
            chunks = source  # type: ignore[assignment]
        size = self._write_blob(file_id, chunks)
        row = {
            "id": file_id,
            "filename": filename,
            "purpose": purpose,
            "bytes": size,
            "created_at": int(time.time()),
        }
        with self._write() as conn:
            conn.execute(
                "INSERT INTO files (id, filename, purpose, bytes, created_at) "
                "VALUES (:id, :filename, :purpose, :bytes, :created_at)",
                row,
            )
        return row

    def get_file(self, file_id: str) -> dict | None:
        """The file's row, or None when unknown (or deleted)."""
        row = self._conn().execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return dict(row) if row else None

    def list_files(
        self, *, purpose: str | None, limit: int, order: str, after: str | None
    ) -> tuple[list[dict], bool]:
        """Files by creation order (``order`` "asc" or "desc"), those after the file id
        ``after`` in that order. Returns (up to ``limit`` rows, whether more exist)."""
        desc = order == "desc"
        where, args = [], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            anchor = self._conn().execute("SELECT rowid FROM files WHERE id = ?", (after,))
            row = anchor.fetchone()
            if row is not None:
                where.append("rowid < ?" if desc else "rowid > ?")
                args.append(row[0])
        sql = "SELECT * FROM files"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY rowid {'DESC' if desc else 'ASC'} LIMIT ?"
        rows = [dict(r) for r in self._conn().execute(sql, (*args, limit + 1))]
        return rows[:limit], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        """Delete a file (row first, then blob). Returns False when it did not exist."""
        with self._write() as conn:
            deleted = conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        if deleted:
            with contextlib.suppress(OSError):
                self.blob_path(file_id).unlink()
        return bool(deleted)

    # ---- batches ------------------------------------------------------------------------
    def create_batch(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        window_s: int,
    ) -> dict:
        """Insert a batch in status ``validating``; returns its row."""
        now = int(time.time())
        batch_id = new_batch_id()
        with self._write() as conn:
            conn.execute(
                "INSERT INTO batches (id, input_file_id, endpoint, completion_window, metadata, "
                "status, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    input_file_id,
                    endpoint,
                    completion_window,
                    None if metadata is None else json.dumps(metadata),
                    VALIDATING,
                    now,
                    now + window_s,
                ),
            )
        return self.get_batch(batch_id)  # type: ignore[return-value]

    def get_batch(self, batch_id: str) -> dict | None:
        row = self._conn().execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return dict(row) if row else None

    def list_batches(self, *, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Batches newest first, starting after the batch id ``after``. Returns (rows, has_more)."""
        args: list[Any] = []
        sql = "SELECT * FROM batches"
        if after is not None:
            row = self._conn().execute("SELECT rowid FROM batches WHERE id = ?", (after,))
            anchor = row.fetchone()
            if anchor is not None:
                sql += " WHERE rowid < ?"
                args.append(anchor[0])
        sql += " ORDER BY rowid DESC LIMIT ?"
        rows = [dict(r) for r in self._conn().execute(sql, (*args, limit + 1))]
        return rows[:limit], len(rows) > limit

    def batches_with_status(self, *statuses: str) -> list[dict]:
        """Batches in any of ``statuses``, oldest first."""
        marks = ",".join("?" * len(statuses))
        sql = f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY rowid"
        return [dict(r) for r in self._conn().execute(sql, statuses)]

    def count_batches_by_status(self) -> dict[str, int]:
        rows = self._conn().execute("SELECT status, COUNT(*) FROM batches GROUP BY status")
        return {status: count for status, count in rows}

    def transition(
        self, batch_id: str, status: str, *, expect: Iterable[str] | None = None, **fields: Any
    ) -> bool:
        """Move a batch to ``status`` (stamping its ``<status>_at`` time) and set ``fields``.

        Args:
            expect: only when the current status is one of these (compare-and-set).
            fields: other columns; dicts are stored as JSON.

        Returns:
            False when the batch is unknown or not in an expected status (nothing changed).
        """
        sets = {"status": status, **fields}
        if status in _STATUS_TIME:
            sets[_STATUS_TIME[status]] = int(time.time())
        values = [json.dumps(v) if isinstance(v, dict) else v for v in sets.values()]
        sql = "UPDATE batches SET " + ", ".join(f"{k} = ?" for k in sets) + " WHERE id = ?"
        args = [*values, batch_id]
        if expect is not None:
            expect = list(expect)
            sql += f" AND status IN ({','.join('?' * len(expect))})"
            args += expect
        with self._write() as conn:
            return conn.execute(sql, args).rowcount == 1

    # ---- requests -----------------------------------------------------------------------
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
            if size >= _COPY_CHUNK:
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
                sets = {"status": status, _STATUS_TIME[status]: now, **ids}
                conn.execute(
                    "UPDATE batches SET " + ", ".join(f"{k} = ?" for k in sets) + " WHERE id = ?",
                    (*sets.values(), batch_id),
                )
        if not ok:
            for file_id in ids.values():
                with contextlib.suppress(OSError):
                    self.blob_path(file_id).unlink()
        return ok
