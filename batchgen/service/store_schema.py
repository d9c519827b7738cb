"""The job store's schema and records: the SQLite tables, the batch and request status names
(OpenAI's), the id formats and the frozen row records that `Store` takes and returns.

Pure data (no I/O), so that the engine loop, the routes and the tests can name statuses and
build rows without opening a store. `batchgen.service.store` re-exports every name here.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

DB_NAME = "batchgen.sqlite3"
BLOB_DIR = "files"
SCHEMA_VERSION = 1
# Bytes per chunk when copying a blob (uploads, output files).
COPY_CHUNK = 1 << 20

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
STATUS_TIME = {
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

SCHEMA = """
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
