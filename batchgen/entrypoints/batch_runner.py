"""Run an OpenAI Batch API input file through an `LLMEngine`, streaming results to a JSONL file.

The input is read line by line (never held whole); at most ``max_in_flight`` requests are in
the engine at once; each result line is written and flushed as soon as its request finishes,
so a killed run loses at most the requests in flight and the tail of one line, which
``resume=True`` repairs. Memory is proportional to ``max_in_flight`` plus the set of custom_ids
(for duplicate detection), not to the file.

With a snapshot (`batchgen.entrypoints.snapshot_store`, ``--snapshot-storage-uri``) every
result line also goes to a durable store, a segment every N results or T seconds. A run that
finds a snapshot of the same job starts by copying the results the output lacks from it, and
storing the output's results the snapshot lacks; it then runs only what neither holds. A result
counts as done once it is in both; either copy alone is enough to restore the other, and
results are matched by custom_id, so a crash between the two writes cannot duplicate one.

Per-line failures (invalid JSON, missing or duplicate custom_id, unknown url, bad fields, a
prompt the engine rejects with ValueError, a request that fails inside the engine) become error
lines; every other line still runs. Any other exception from the engine propagates: it is a bug,
not a bad request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from batchgen.entrypoints.openai_protocol import (
    DUPLICATE_CUSTOM_ID,
    REQUEST_FAILED,
    BatchLineError,
    BatchRequest,
    BlankLines,
    batch_line_custom_id,
    dumps_line,
    error_line,
    error_line_from,
    parse_batch_line,
    rejected_error,
    response_body,
    success_line,
)
from batchgen.entrypoints.model_names import ModelNameTally
from batchgen.entrypoints.snapshot_store import (
    SnapshotTakenOverError,
    SnapshotWriteError,
    SnapshotWriter,
)
from batchgen.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Results are flushed to the OS after every engine step; fsync'ed at most this often and at the
# end (flush alone survives a killed process; fsync also survives a machine crash).
FSYNC_INTERVAL_S = 30.0


class BatchFileError(ValueError):
    """The input or output file cannot be used (message for the user)."""


@dataclass
class BatchRunSummary:
    """What `run_batch_file` did.

    Attributes:
        total: non-blank input lines seen.
        succeeded / failed: result lines written by this run (success / error).
        skipped: lines skipped because the output already held their result (``resume``) or
            the snapshot did.
        restored: results copied from the snapshot into the output (counted in ``skipped``).
        ignored: results in the snapshot for no request of this input (another job's), left
            out of the output.
        blank_lines: blank lines between request lines, skipped (blank lines after the last
            request line are not counted).
        prompt_tokens / generated_tokens: over the requests that succeeded in this run
            (generated tokens summed over all ``n`` samples).
        elapsed_s: wall-clock seconds of the run (after counting lines and reading the old
            output).
        prefix_cache_queries / prefix_cache_hits: the engine's prefix cache over the run
            (`LLMEngine.get_metrics`): prompt tokens looked up, and those found cached.
    """

    total: int = 0
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    restored: int = 0
    ignored: int = 0
    blank_lines: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def describe(self) -> str:
        """One human-readable line."""
        skipped = f", {self.skipped} skipped (already done)" if self.skipped else ""
        if self.restored:
            skipped += f", {self.restored} of them restored from the snapshot"
        if self.ignored:
            skipped += f", {self.ignored} snapshot results ignored (no such request in the input)"
        blank = ""
        if self.blank_lines:
            noun = "line" if self.blank_lines == 1 else "lines"
            blank = f"; {self.blank_lines} blank {noun} skipped"
        return (
            f"{self.succeeded} ok, {self.failed} failed{skipped} of {self.total} requests"
            f"{blank}; "
            f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens in "
            f"{self.elapsed_s:.1f} s ({self.generated_tokens_per_s:.1f} generated tokens/s)"
            f"{self._prefix_cache_text()}"
        )

    def _prefix_cache_text(self) -> str:
        if not self.prefix_cache_queries:
            return ""
        rate = 100 * self.prefix_cache_hits / self.prefix_cache_queries
        return (
            f"; prefix cache: {self.prefix_cache_hits} of {self.prefix_cache_queries} prompt "
            f"tokens cached ({rate:.1f}%)"
        )


def _note_prefix_cache(summary: BatchRunSummary, engine: Any) -> None:
    """Copy the engine's prefix-cache counters into ``summary`` (an engine without
    ``get_metrics``, as in tests, leaves them 0)."""
    get_metrics = getattr(engine, "get_metrics", None)
    if get_metrics is None:
        return
    metrics = get_metrics()
    summary.prefix_cache_queries = int(metrics.get("prefix_cache_queries", 0))
    summary.prefix_cache_hits = int(metrics.get("prefix_cache_hits", 0))


@dataclass
class ResumeState:
    """Which input lines already have a result in an existing output file.

    Attributes:
        done_ids: custom_ids with a success line or an error line of their own.
        done_lines: 1-based input line numbers of error lines that a custom_id cannot stand for:
            lines without a usable custom_id, and duplicate-custom_id errors (whose custom_id
            belongs to an earlier line, which may itself not be done yet).
    """

    done_ids: set[str] = field(default_factory=set)
    done_lines: set[int] = field(default_factory=set)

    def add(self, result: dict[str, Any]) -> None:
        key = result_key(result)
        if key is None:
            return
        kind, value = key
        (self.done_lines if kind == "line" else self.done_ids).add(value)

    def has(self, result: dict[str, Any]) -> bool:
        key = result_key(result)
        if key is None:
            return False
        kind, value = key
        return value in (self.done_lines if kind == "line" else self.done_ids)


def result_key(result: dict[str, Any]) -> tuple[str, Any] | None:
    """What a result line answers: ``("id", custom_id)``, or ``("line", n)`` for an error line
    a custom_id cannot stand for (`ResumeState`); None for neither."""
    custom_id, error = result.get("custom_id"), result.get("error")
    if isinstance(error, dict) and (custom_id is None or error.get("code") == DUPLICATE_CUSTOM_ID):
        line = error.get("line")
        return ("line", line) if isinstance(line, int) else None
    return ("id", custom_id) if isinstance(custom_id, str) else None


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


def load_resume_state(output_path: str | os.PathLike) -> ResumeState:
    """Read the results already in ``output_path``, then cut a partial last line.

    Every complete line is checked before anything is truncated, so pointing ``--resume`` at
    a file that is not a results file changes nothing in it.

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
                break  # the partial last line, cut below
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
    truncate_partial_last_line(output_path)
    return state


def count_request_lines(path: str | os.PathLike) -> int:
    """Number of non-blank lines of a file, read in a streaming pass."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def input_result_keys(path: str | os.PathLike) -> tuple[int, ResumeState]:
    """(non-blank lines, the keys of the results the input can have) in one streaming pass.

    The keys are what `result_key` gives the result line `run_batch_file` writes for each
    request line: its custom_id, or its line number for a line without a usable custom_id and
    for a duplicate (`ResumeState`). Memory: the set of custom_ids (which the run holds anyway).
    """
    keys = ResumeState()
    count = 0
    with open(path, "rb") as f:
        for line, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            count += 1
            custom_id = batch_line_custom_id(raw, line)
            if custom_id is None or custom_id in keys.done_ids:
                keys.done_lines.add(line)
            else:
                keys.done_ids.add(custom_id)
    return count, keys


class _ResultWriter:
    """Appends JSONL result lines; `flush` pushes them to the OS, fsync'ing now and then, and
    then to the snapshot when one is due."""

    def __init__(self, sink: IO[bytes], snapshot: SnapshotWriter | None = None):
        self._sink = sink
        self._snapshot = snapshot
        self._last_fsync = time.monotonic()
        # fsync only makes sense for a regular file (``-o /dev/null`` or a pipe rejects it).
        self._can_fsync = stat.S_ISREG(os.fstat(sink.fileno()).st_mode)

    def write(self, result: dict[str, Any]) -> None:
        line = (dumps_line(result) + "\n").encode("utf-8")
        self._sink.write(line)
        if self._snapshot is not None:
            self._snapshot.add(line)

    def flush(self, *, fsync: bool = False) -> None:
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


class _BatchRun:
    """The state of one `run_batch_file` call: requests in flight, ids seen, counters."""

    def __init__(
        self,
        engine: Any,
        writer: _ResultWriter,
        resume: ResumeState,
        max_in_flight: int,
        bar: tqdm,
    ):
        self.engine = engine
        self.writer = writer
        self.resume = resume
        self.max_in_flight = max_in_flight
        self.bar = bar
        self.summary = BatchRunSummary()
        self.in_flight: dict[str, BatchRequest] = {}  # engine request id -> request
        self.seen_ids: set[str] = set()
        self.blank = BlankLines()
        self.models = ModelNameTally(engine.model_name)
        self._start = time.perf_counter()

    def run(self, lines: Iterator[tuple[int, bytes]]) -> BatchRunSummary:
        try:
            self._loop(lines)
        except BaseException:
            self._abort_in_flight()
            raise
        finally:
            self.summary.elapsed_s = time.perf_counter() - self._start
            self.summary.blank_lines = self.blank.count
        return self.summary

    def _loop(self, lines: Iterator[tuple[int, bytes]]) -> None:
        exhausted = False
        while True:
            while not exhausted and len(self.in_flight) < self.max_in_flight:
                item = next(lines, None)
                if item is None:
                    exhausted = True
                else:
                    self._admit(*item)
            self.writer.flush()
            if not self.in_flight:
                return
            self._step()

    def _admit(self, line: int, raw: bytes) -> None:
        """Parse one input line and add it to the engine, or record why not."""
        if self.blank.skip(line, raw):
            return
        self.summary.total += 1
        if line in self.resume.done_lines:
            return self._skip()
        try:
            request = parse_batch_line(raw, line)
        except BatchLineError as err:
            if err.custom_id is not None:
                if err.custom_id in self.resume.done_ids:
                    self.seen_ids.add(err.custom_id)
                    return self._skip()
                if self._is_duplicate(err.custom_id, line):
                    return
            return self._fail(error_line_from(err))
        if self._is_duplicate(request.custom_id, line):
            return
        if request.custom_id in self.resume.done_ids:
            return self._skip()
        self._submit(request)

    def _is_duplicate(self, custom_id: str, line: int) -> bool:
        """Record ``custom_id``; on its second occurrence write the duplicate error line."""
        if custom_id not in self.seen_ids:
            self.seen_ids.add(custom_id)
            return False
        message = f"line {line}: duplicate custom_id {custom_id!r} (it appeared on an earlier line)"
        self._fail(
            error_line(custom_id, DUPLICATE_CUSTOM_ID, message, param="custom_id", line=line)
        )
        return True

    def _submit(self, request: BatchRequest) -> None:
        request_id = f"req_{uuid.uuid4().hex}"
        api = request.request
        try:
            prompt = self.engine.apply_chat_template(api.messages) if api.is_chat else api.prompt
            self.engine.add_request(
                request_id, prompt, api.sampling_params, max_tokens_must_fit=True
            )
        except ValueError as err:
            message = f"line {request.line}: {err}"
            code, param = rejected_error(api, err)
            self._fail(error_line(request.custom_id, code, message, param=param, line=request.line))
            return
        self.models.add(api.model)
        self.in_flight[request_id] = request

    def _step(self) -> None:
        if not self.engine.has_unfinished_requests():
            raise RuntimeError(
                f"the engine has no unfinished requests but {len(self.in_flight)} batch "
                "requests are in flight"
            )
        for output in self.engine.step():
            if output.finished:
                self._finish(output)
        self.writer.flush()
        self.bar.set_postfix(
            {"gen tok/s": f"{self._tokens_per_s():.1f}", "failed": self.summary.failed},
            refresh=False,
        )

    def _finish(self, output: RequestOutput) -> None:
        request = self.in_flight.pop(output.request_id, None)
        if request is None:
            raise RuntimeError(f"the engine returned an unknown request id {output.request_id!r}")
        if output.error is not None:
            message = f"line {request.line}: {output.error}"
            self._fail(error_line(request.custom_id, REQUEST_FAILED, message, line=request.line))
            return
        body = response_body(
            request.request,
            output,
            model=self.engine.model_name,
            tokenizer=self.engine.tokenizer,
        )
        self.writer.write(success_line(request.custom_id, output.request_id, body))
        self.summary.succeeded += 1
        self.summary.prompt_tokens += len(output.prompt_token_ids)
        self.summary.generated_tokens += output.num_generated_tokens
        self.bar.update(1)

    def _fail(self, result: dict[str, Any]) -> None:
        self.writer.write(result)
        self.summary.failed += 1
        self.bar.update(1)

    def _skip(self) -> None:
        self.summary.skipped += 1
        self.bar.update(1)

    def _tokens_per_s(self) -> float:
        elapsed = time.perf_counter() - self._start
        return self.summary.generated_tokens / elapsed if elapsed > 0 else 0.0

    def _abort_in_flight(self) -> None:
        """Leave the engine clean for its next user when the run stops early."""
        for request_id in list(self.in_flight):
            # The exception that stopped the run is the one to report, not a failed abort.
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
        self.in_flight.clear()


def _sync_with_snapshot(
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
    in ``expected``, `input_result_keys`) are copied: a snapshot holding others (another
    job's) never puts a line in the output for a custom_id the input does not have, nor its
    text under one it has by chance. Streams both: memory is one segment plus the keys.
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
                if result is not None and result_key(result) and not stored.has(result):
                    stored.add(result)
                    snapshot.add(raw)
        if snapshot.pending:
            logger.info("storing %d results the snapshot lacked", snapshot.pending)
            snapshot.flush()
    return restored, ignored


def run_batch_file(
    engine: Any,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    resume: bool = False,
    max_in_flight: int = 1024,
    progress: bool = True,
    snapshot: SnapshotWriter | None = None,
) -> BatchRunSummary:
    """Run every request of an OpenAI Batch input file and write one result line per input line.

    Args:
        engine: an `LLMEngine` (``add_request``, ``apply_chat_template``, ``step``,
            ``has_unfinished_requests``, ``abort_request``, ``tokenizer``, ``model_name``).
        input_path: JSONL input, one request per line (see `parse_batch_line`); blank lines are
            skipped, with a warning naming those before the last request line. A line whose
            body names a ``model`` other than ``engine.model_name`` runs on the engine's model;
            the run ends with one warning per such name (`ModelNameTally`).
        output_path: JSONL output, written in completion order (not input order); match lines
            by ``custom_id``. Overwritten unless ``resume``.
        resume: keep the results already in ``output_path`` (cutting a half-written last line),
            skip their input lines and append the rest. Assumes the same input file.
        max_in_flight: most requests in the engine at once (each with its ``n`` samples).
        progress: show a tqdm bar on stderr (requests done / total, generated tokens/s).
        snapshot: also store every result line in this snapshot (its store bound to this job
            by `SnapshotStore.open_job`); results the snapshot already holds are copied into
            the output (whether or not ``resume``) and not run again, and results the resumed
            output holds but the snapshot lacks are stored first (module docstring). Only
            results for a request of this input are copied; any other (another job's) is
            counted in ``ignored``, with a warning. Needs a regular input file.

    Returns:
        The counts of this run.

    Raises:
        FileNotFoundError: the input file does not exist.
        BatchFileError: input and output are the same file, or ``resume`` found an output that
            is not a batch result file.
        ValueError: ``max_in_flight`` < 1.
        SnapshotTakenOverError: another job replaced the snapshot's manifest mid-run.
        SnapshotWriteError: the snapshot could not be written mid-run.
        Exception: anything the engine raises other than a per-request ValueError; requests
            still in flight are aborted first and the results written so far stay on disk
            (and are stored in the snapshot where it still works).
    """
    input_path, output_path = Path(input_path), Path(output_path)
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if not input_path.exists():
        raise FileNotFoundError(f"input file {str(input_path)!r} does not exist")
    if input_path.is_dir():
        raise BatchFileError(f"input {str(input_path)!r} is a directory, not a JSONL file")
    if output_path.exists() and output_path.samefile(input_path):
        raise BatchFileError(f"the output file {str(output_path)!r} is the input file")
    state = ResumeState()
    local_size = 0  # bytes of results the output held before this run
    if resume and output_path.exists():
        state = load_resume_state(output_path)
        local_size = os.path.getsize(output_path)
    # A pipe or FIFO (`-i <(zcat big.jsonl.gz)`) can be read once only: no total then.
    counted = (progress or snapshot is not None) and input_path.is_file()
    expected = None
    if snapshot is not None:
        if not input_path.is_file():
            raise BatchFileError(
                f"a snapshot needs a regular input file, not {str(input_path)!r} (a pipe)"
            )
        total, expected = input_result_keys(input_path)
    else:
        total = count_request_lines(input_path) if counted else None
    with (
        open(input_path, "rb") as source,
        open(output_path, "ab" if resume else "wb") as sink,
        tqdm(total=total, unit="req", disable=not progress, file=sys.stderr) as bar,
    ):
        restored = ignored = 0
        if snapshot is not None:
            snapshot.total = total
            restored, ignored = _sync_with_snapshot(
                snapshot, sink, state, output_path, local_size, expected or ResumeState()
            )
        writer = _ResultWriter(sink, snapshot)
        batch_run = _BatchRun(engine, writer, state, max_in_flight, bar)
        try:
            summary = batch_run.run(enumerate(source, start=1))
        except BaseException as err:
            # A snapshot that refused or failed a write is not tried again for the last ones.
            snapshot_failed = isinstance(err, (SnapshotTakenOverError, SnapshotWriteError))
            try:
                writer.close(finished=False, snapshot=not snapshot_failed)
            except Exception as close_err:  # the engine's exception is the one to report
                logger.warning("could not store the last results in the snapshot: %s", close_err)
            raise
        writer.close(finished=True)
        _note_prefix_cache(summary, engine)
        summary.restored = restored
        summary.ignored = ignored
    if batch_run.blank.count:
        logger.warning(
            "%s: skipped %s between requests (a batch file holds one request per line)",
            input_path,
            batch_run.blank.describe(),
        )
    batch_run.models.warn(logger, str(input_path))
    return summary
