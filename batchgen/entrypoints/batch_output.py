"""The output side of ``batchgen run``: result lines written and fsync'ed, and the bookkeeping
that lets a run resume.

* `ResultWriter`: appends JSONL result lines, flushes them after every engine step, fsyncs at
  most every `FSYNC_INTERVAL_S` and at the end, and passes each line to the snapshot when one
  is used.
* `ResumeState` / `result_key` / `scan_results_file` / `load_resume_state`: which requests an
  existing output already answers (by custom_id, or by line number for an error line no
  custom_id can stand for), which of those answers are errors (`is_failed_result`, for
  ``--retry-failed``) and which answer no request of the input, and cutting a half-written
  last line (`truncate_partial_last_line`). What ``--resume`` and ``--retry-failed`` do with
  them is in `batchgen.entrypoints.batch_resume`.
* `sync_with_snapshot`: before a run, make the output and the snapshot hold the same results.
* `BatchFileError`: the input or output file cannot be used.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from batchgen.entrypoints.openai_protocol import DUPLICATE_CUSTOM_ID, dumps_line
from batchgen.entrypoints.snapshot_store import SnapshotWriter

logger = logging.getLogger(__name__)

# Results are flushed to the OS after every engine step; fsync'ed at most this often and at the
# end (flush alone survives a killed process; fsync also survives a machine crash).
FSYNC_INTERVAL_S = 30.0


class BatchFileError(ValueError):
    """The input or output file cannot be used (message for the user)."""


@dataclass
class ResumeState:
    """Which input lines already have a result in an existing output file.

    Attributes:
        done_ids: custom_ids with a success line or an error line of their own.
        done_lines: ``(line, custom_id)`` of error lines that a custom_id alone cannot stand
            for: lines without a usable custom_id (``custom_id`` None), and duplicate-custom_id
            errors (whose custom_id belongs to an earlier line, which may itself not be done
            yet). ``line`` is 1-based; the pair must match the input line (its number and the
            custom_id it names), so a line inserted into the input since is not taken for done.
        failed: the `result_key` of each done request whose only results are errors
            (`is_failed_result`); a key that also has a success is not in it.
        num_results: result lines read (`scan_results_file`).
        num_failed_lines: error result lines among them (those of ``failed``, and any error
            line for a key that also has a success).
        foreign: result lines that answer no request of the input (counted only when
            `scan_results_file` is given the input's keys).
        foreign_sample: the first `FOREIGN_SAMPLE` of those, described (`describe_key`), in
            file order.
    """

    done_ids: set[str] = field(default_factory=set)
    done_lines: set[tuple[int, str | None]] = field(default_factory=set)
    failed: set[tuple[str, Any]] = field(default_factory=set)
    num_results: int = 0
    num_failed_lines: int = 0
    foreign: int = 0
    foreign_sample: list[str] = field(default_factory=list)

    @property
    def done_line_numbers(self) -> set[int]:
        """The line numbers of `done_lines` (a cheap first test before a line's custom_id is
        read)."""
        return {line for line, _ in self.done_lines}

    def add(self, result: dict[str, Any]) -> None:
        """Record ``result`` as the answer to its key (a success wins over an error)."""
        key = result_key(result)
        if key is None:
            return
        known = self.has_key(key)
        kind, value = key
        (self.done_lines if kind == "line" else self.done_ids).add(value)
        if not is_failed_result(result):
            self.failed.discard(key)
        elif not known:  # a key answered by a success before stays answered
            self.failed.add(key)

    def has(self, result: dict[str, Any]) -> bool:
        key = result_key(result)
        return key is not None and self.has_key(key)

    def has_key(self, key: tuple[str, Any]) -> bool:
        """Whether ``key`` (a `result_key`) is done."""
        kind, value = key
        return value in (self.done_lines if kind == "line" else self.done_ids)


# How many foreign results a warning or an error names.
FOREIGN_SAMPLE = 3


def result_key(result: dict[str, Any]) -> tuple[str, Any] | None:
    """What a result line answers: ``("id", custom_id)``, or ``("line", (n, custom_id))`` for
    an error line a custom_id cannot stand for (`ResumeState`; ``custom_id`` None when the line
    had no usable one); None for neither."""
    custom_id, error = result.get("custom_id"), result.get("error")
    if isinstance(error, dict) and (custom_id is None or error.get("code") == DUPLICATE_CUSTOM_ID):
        line = error.get("line")
        if not isinstance(line, int):
            return None
        return ("line", (line, custom_id if isinstance(custom_id, str) else None))
    return ("id", custom_id) if isinstance(custom_id, str) else None


def describe_key(key: tuple[str, Any]) -> str:
    """A `result_key` for a message: ``"req-7"`` (JSON-quoted), ``line 4`` or ``"a" (line 4)``."""
    kind, value = key
    if kind == "id":
        return json.dumps(value, ensure_ascii=False)
    line, custom_id = value
    return f"line {line}" if custom_id is None else f"{json.dumps(custom_id)} (line {line})"


def _describe_keyless(result: dict[str, Any]) -> str:
    """A result no `result_key` stands for, for a message: ``custom_id 7``, ``custom_id
    null`` (its custom_id as JSON, cut at 40 characters)."""
    text = json.dumps(result.get("custom_id"), ensure_ascii=False)
    return f"custom_id {text if len(text) <= 40 else text[:39] + '…'}"


def is_failed_result(result: dict[str, Any]) -> bool:
    """Whether a result line reports a failure: its ``error`` is not null, or its
    ``response.status_code`` is an HTTP status outside 2xx (``batchgen run`` writes both for
    every failed line: 400 and ``error`` set; an OpenAI Batch output file may carry a 4xx/5xx
    response with ``error`` null)."""
    if result.get("error") is not None:
        return True
    response = result.get("response")
    status = response.get("status_code") if isinstance(response, dict) else None
    return isinstance(status, int) and not 200 <= status < 300


def complete_prefix_size(path: str | os.PathLike) -> int:
    """Size in bytes of the file up to and including its last newline (0 when it has none)."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:
            start = max(0, end - (1 << 16))
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                return start + newline + 1
            end = start
    return 0


def truncate_partial_last_line(path: str | os.PathLike) -> int:
    """Cut a file back to its last newline (a line half-written by a killed process).

    Returns the number of bytes removed (0 when the file ends with a newline or is empty).
    """
    keep = complete_prefix_size(path)
    size = os.path.getsize(path)
    if keep < size:
        with open(path, "r+b") as f:
            f.truncate(keep)
    return size - keep


def scan_results_file(
    output_path: str | os.PathLike, expected: ResumeState | None = None
) -> ResumeState:
    """Read the results in ``output_path`` without changing the file.

    Args:
        output_path: an output of ``batchgen run``; a half-written last line is not read.
        expected: the keys of the results the input can have (`input_result_keys`); when
            given, results for none of them are counted in ``foreign``.

    Returns:
        The results' keys, which of them are errors, and the counts (`ResumeState`).

    Raises:
        BatchFileError: a complete line is not a JSON result line, or the file has content but
            no complete line (i.e. it is not an output of ``batchgen run``).
    """
    keep = complete_prefix_size(output_path)
    size = os.path.getsize(output_path)
    if keep == 0 and size > 0:
        raise BatchFileError(
            f"{output_path} has {size} bytes but no complete result line; cannot resume "
            "(move the file away to start over)"
        )
    state = ResumeState()
    with open(output_path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                break  # the partial last line
            if not raw.strip():
                continue
            try:
                result = json.loads(raw)
            except ValueError:
                result = None
            if not isinstance(result, dict) or "custom_id" not in result:
                raise BatchFileError(
                    f"{output_path}:{number} is not a batch result line; cannot resume "
                    "(move the file away to start over)"
                )
            state.add(result)
            state.num_results += 1
            state.num_failed_lines += is_failed_result(result)
            key = result_key(result)
            if expected is not None and (key is None or not expected.has_key(key)):
                state.foreign += 1
                if len(state.foreign_sample) < FOREIGN_SAMPLE:
                    state.foreign_sample.append(
                        _describe_keyless(result) if key is None else describe_key(key)
                    )
    return state


def load_resume_state(
    output_path: str | os.PathLike, expected: ResumeState | None = None
) -> ResumeState:
    """`scan_results_file`, then cut a partial last line.

    Every complete line is checked before anything is truncated, so pointing ``--resume`` at
    a file that is not a results file changes nothing in it.

    Raises:
        BatchFileError: as `scan_results_file`.
    """
    state = scan_results_file(output_path, expected)
    truncate_partial_last_line(output_path)
    return state


class ResultWriter:
    """Appends JSONL result lines; `flush` pushes them to the OS, fsync'ing now and then, and
    then to the snapshot when one is due."""

    def __init__(self, sink: IO[bytes], snapshot: SnapshotWriter | None = None):
        self._sink = sink
        self._snapshot = snapshot
        self._last_fsync = time.monotonic()
        # fsync only makes sense for a regular file (``-o /dev/null`` or a pipe rejects it).
        self._can_fsync = stat.S_ISREG(os.fstat(sink.fileno()).st_mode)

    def write(self, result: dict[str, Any]) -> None:
        """Append one result line (and add it to the snapshot's buffer)."""
        line = (dumps_line(result) + "\n").encode("utf-8")
        self._sink.write(line)
        if self._snapshot is not None:
            self._snapshot.add(line)

    def flush(self, *, fsync: bool = False) -> None:
        """Push the lines to the OS; fsync when ``fsync`` or `FSYNC_INTERVAL_S` has passed;
        store a segment in the snapshot when one is due."""
        self._sink.flush()
        if self._can_fsync and (fsync or time.monotonic() - self._last_fsync > FSYNC_INTERVAL_S):
            os.fsync(self._sink.fileno())
            self._last_fsync = time.monotonic()
        if self._snapshot is not None:
            self._snapshot.maybe_flush()

    def close(self, *, finished: bool, snapshot: bool = True) -> None:
        """Flush and fsync the output, then store every buffered line in the snapshot (unless
        not ``snapshot``)."""
        self._sink.flush()
        if self._can_fsync:
            os.fsync(self._sink.fileno())
        if self._snapshot is not None and snapshot:
            self._snapshot.flush(finished=finished)


def sync_with_snapshot(
    snapshot: SnapshotWriter,
    sink: IO[bytes],
    state: ResumeState,
    output_path: Path,
    local_size: int,
    expected: ResumeState,
) -> tuple[int, int]:
    """Make the output and the snapshot hold the same results before a run starts.

    Appends to ``sink`` (the output, its first ``local_size`` bytes the results it already
    held, recorded in ``state``) each snapshot result it lacks, adding it to ``state``; then
    stores in the snapshot each of those ``local_size`` bytes' results the snapshot lacks (a
    run killed between its two writes). Only results for a request of this input (their keys
    in ``expected``, `input_result_keys`) are copied, either way: a snapshot holding others
    (another job's) never puts a line in the output for a custom_id the input does not have,
    nor its text under one it has by chance, and a resumed output's results for lines deleted
    from the input are not stored. Streams both: memory is one segment plus the keys.
    Returns the number of results copied from the snapshot and the number ignored.
    """
    stored = ResumeState()
    held = restored = ignored = 0
    for line in snapshot.store.iter_result_lines():
        try:
            result = json.loads(line)
        except ValueError:
            result = None
        if not isinstance(result, dict) or result_key(result) is None:
            logger.warning("snapshot %s: ignoring a line that is not a result", snapshot.store.uri)
            continue
        if not expected.has(result):
            ignored += 1
            continue
        if stored.has(result):
            continue  # a second copy (never written by batchgen; tolerated)
        stored.add(result)
        held += 1
        if not state.has(result):
            sink.write(line)
            state.add(result)
            restored += 1
    sink.flush()
    if ignored:
        logger.warning(
            "snapshot %s: ignored %d results for requests this input does not have (another "
            "job's results are stored there)",
            snapshot.store.uri,
            ignored,
        )
    snapshot.stored_results = held
    if local_size:
        with open(output_path, "rb") as f:
            remaining = local_size
            for raw in f:
                remaining -= len(raw)
                if remaining < 0:
                    break  # past what the output held: the lines just restored
                result = json.loads(raw) if raw.strip() else None
                # Only this input's results: the output may hold others (`--resume` warns).
                if result is not None and expected.has(result) and not stored.has(result):
                    stored.add(result)
                    snapshot.add(raw)
        if snapshot.pending:
            logger.info("storing %d results the snapshot lacked", snapshot.pending)
            snapshot.flush()
    return restored, ignored
