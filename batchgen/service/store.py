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

Modules: the tables, status names, ids and row records are in `batchgen.service.store_schema`
(re-exported here); the request-row methods (input rows, the per-step commit, the output files)
are in `batchgen.service.store_requests`; this module holds `Store` itself: connections, blobs,
files and batches.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from batchgen.service.store_requests import RequestRows
from batchgen.service.store_schema import (  # noqa: F401  (re-exported: `store.PENDING` etc.)
    BATCH_ID_RE,
    BLOB_DIR,
    CANCELLED,
    CANCELLING,
    COMPLETED,
    COPY_CHUNK,
    DB_NAME,
    EXPIRED,
    FAILED,
    FILE_ID_RE,
    FINALIZING,
    IN_PROGRESS,
    PENDING,
    REQUEST_FAILED,
    SCHEMA,
    SCHEMA_VERSION,
    STATUS_TIME,
    SUCCEEDED,
    TERMINAL_STATUSES,
    VALIDATING,
    FinishedRequest,
    InputRow,
    PendingRequest,
    StoredResult,
    new_batch_id,
    new_file_id,
)


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


class Store(RequestRows):
    """SQLite + blob store under ``state_dir`` (created when missing).

    Raises:
        OSError: ``state_dir`` cannot be created or written.
        sqlite3.DatabaseError: the database file is corrupt or not a BatchGen store.

    The request-row methods (`insert_requests`, `commit_progress`, `finish_batch`, ...) come
    from `RequestRows`.
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
            for statement in SCHEMA.split(";"):
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
            chunks: Iterable[bytes] = iter(lambda: source.read(COPY_CHUNK), b"")  # type: ignore[union-attr]
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
        if status in STATUS_TIME:
            sets[STATUS_TIME[status]] = int(time.time())
        values = [json.dumps(v) if isinstance(v, dict) else v for v in sets.values()]
        sql = "UPDATE batches SET " + ", ".join(f"{k} = ?" for k in sets) + " WHERE id = ?"
        args = [*values, batch_id]
        if expect is not None:
            expect = list(expect)
            sql += f" AND status IN ({','.join('?' * len(expect))})"
            args += expect
        with self._write() as conn:
            return conn.execute(sql, args).rowcount == 1
