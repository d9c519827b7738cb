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

This module holds the run loop (`run_batch_file`); the output writer and resume bookkeeping are
in `batchgen.entrypoints.batch_output`, what ``resume`` and ``retry_failed`` keep of an
existing output in `batchgen.entrypoints.batch_resume`, the passes over the input before the
run in `batchgen.entrypoints.batch_input`, the counts in `batchgen.entrypoints.batch_summary`
(their names are re-exported here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from batchgen.entrypoints.batch_input import (  # noqa: F401  (re-exported)
    count_request_lines,
    input_result_keys,
)
from batchgen.entrypoints.batch_output import (  # noqa: F401  (re-exported)
    FSYNC_INTERVAL_S,
    BatchFileError,
    ResultWriter,
    ResumeState,
    complete_prefix_size,
    load_resume_state,
    result_key,
    sync_with_snapshot,
    truncate_partial_last_line,
)
from batchgen.entrypoints.batch_resume import check_snapshot_for_retry, prepare_resume
from batchgen.entrypoints.batch_summary import (  # noqa: F401  (re-exported)
    BatchRunSummary,
    note_prefix_cache,
)
from batchgen.entrypoints.model_names import ModelNameTally
from batchgen.entrypoints.openai_protocol import (
    REQUEST_FAILED,
    BatchLineError,
    BatchRequest,
    BlankLines,
    batch_line_custom_id,
    duplicate_custom_id_line,
    error_line,
    error_line_from,
    parse_batch_line,
    rejected_error,
    response_body,
    success_line,
)
from batchgen.entrypoints.snapshot_store import (
    SnapshotTakenOverError,
    SnapshotWriteError,
    SnapshotWriter,
)
from batchgen.outputs import RequestOutput

logger = logging.getLogger(__name__)


class _BatchRun:
    """The state of one `run_batch_file` call: requests in flight, ids seen, counters."""

    def __init__(
        self,
        engine: Any,
        writer: ResultWriter,
        resume: ResumeState,
        max_in_flight: int,
        bar: tqdm,
    ):
        self.engine = engine
        self.writer = writer
        self.resume = resume
        self.resumed_line_numbers = resume.done_line_numbers
        self.max_in_flight = max_in_flight
        self.bar = bar
        self.summary = BatchRunSummary()
        self.in_flight: dict[str, BatchRequest] = {}  # engine request id -> request
        self.seen_ids: dict[str, int] = {}  # custom_id -> 1-based line of its first use
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
        if line in self.resumed_line_numbers and self._answered_by_line(line, raw):
            return self._skip()
        try:
            request = parse_batch_line(raw, line)
        except BatchLineError as err:
            if err.custom_id is not None:
                # A duplicate first, as for a valid line: its result is keyed by its line
                # number, so its custom_id being done (the first line's) does not answer it.
                if self._is_duplicate(err.custom_id, line):
                    return
                if err.custom_id in self.resume.done_ids:
                    return self._skip()
            return self._fail(error_line_from(err))
        if self._is_duplicate(request.custom_id, line):
            return
        if request.custom_id in self.resume.done_ids:
            return self._skip()
        self._submit(request)

    def _answered_by_line(self, line: int, raw: bytes) -> bool:
        """Whether an error line of the output keyed by this line (`result_key`: its number
        and custom_id) answers it: a line without a usable custom_id, or a duplicate. A
        line whose custom_id no earlier line used is no duplicate now (the input was edited
        since): its answer is a result for its custom_id, not that old error."""
        custom_id = batch_line_custom_id(raw, line)
        if (line, custom_id) not in self.resume.done_lines:
            return False
        return custom_id is None or custom_id in self.seen_ids

    def _is_duplicate(self, custom_id: str, line: int) -> bool:
        """Record ``custom_id``; on its second occurrence write the duplicate error line."""
        first_line = self.seen_ids.setdefault(custom_id, line)
        if first_line == line:
            return False
        self._fail(duplicate_custom_id_line(custom_id, line, first_line))
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


def run_batch_file(
    engine: Any,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    resume: bool = False,
    retry_failed: bool = False,
    max_in_flight: int = 1024,
    progress: bool = True,
    snapshot: SnapshotWriter | None = None,
    on_complete: Callable[[], None] | None = None,
) -> BatchRunSummary:
    """Run every request of an OpenAI Batch input file and write one result line per input line.

    Takes no lock on ``output_path``: ``batchgen run`` holds `output_lock` around this call,
    and a caller running two of these on one output gets results twice or loses some.

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
            skip their input lines and append the rest. Meant for the same input file: an
            output none of whose results is for a request of the input is refused, one with
            some such results gets a warning (`batchgen.entrypoints.batch_resume`; not checked
            for a pipe input).
        retry_failed: implies ``resume``, and also runs again the lines whose result in the
            output is an error (`is_failed_result`): their error lines are dropped from the
            output first, atomically, so it ends with one result per line. Refused with a
            snapshot that holds error results (`check_snapshot_for_retry`).
        max_in_flight: most requests in the engine at once (each with its ``n`` samples).
        progress: show a tqdm bar on stderr (requests done / total, generated tokens/s).
        snapshot: also store every result line in this snapshot (its store bound to this job
            by `SnapshotStore.open_job`); results the snapshot already holds are copied into
            the output (whether or not ``resume``) and not run again, and results the resumed
            output holds but the snapshot lacks are stored first (module docstring). Only
            results for a request of this input are copied; any other (another job's) is
            counted in ``ignored``, with a warning. Needs a regular input file.
        on_complete: called once every result is written (the output flushed and synced, the
            snapshot stored), before the files close: ``batchgen run`` marks its work done
            there (`cli_signals.work_done`), so that a signal from then on does not turn the
            finished run into an interrupted one.

    Returns:
        The counts of this run.

    Raises:
        FileNotFoundError: the input file does not exist.
        BatchFileError: input and output are the same file, ``resume`` found an output that
            is not a batch result file or holds only another input's results, or
            ``retry_failed`` met a snapshot holding error results.
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
    if snapshot is not None and not input_path.is_file():
        raise BatchFileError(
            f"a snapshot needs a regular input file, not {str(input_path)!r} (a pipe)"
        )
    resume = resume or retry_failed
    resuming = resume and output_path.exists()
    # A pipe or FIFO (`-i <(zcat big.jsonl.gz)`) can be read once only: no total then, and no
    # check that a resumed output's results are this input's.
    expected = None
    if snapshot is not None or (resuming and input_path.is_file()):
        total, expected = input_result_keys(input_path)
    else:
        total = count_request_lines(input_path) if progress and input_path.is_file() else None
    if retry_failed and snapshot is not None:
        check_snapshot_for_retry(snapshot, expected)  # before the output changes
    state, dropped = ResumeState(), 0
    local_size = 0  # bytes of results the output held before this run
    if resuming:
        state, dropped = prepare_resume(
            input_path, output_path, expected, retry_failed=retry_failed
        )
        local_size = os.path.getsize(output_path)
    with (
        open(input_path, "rb") as source,
        open(output_path, "ab" if resume else "wb") as sink,
        tqdm(total=total, unit="req", disable=not progress, file=sys.stderr) as bar,
    ):
        restored = ignored = 0
        if snapshot is not None:
            snapshot.total = total
            restored, ignored = sync_with_snapshot(
                snapshot, sink, state, output_path, local_size, expected or ResumeState()
            )
        writer = ResultWriter(sink, snapshot)
        batch_run = _BatchRun(engine, writer, state, max_in_flight, bar)
        try:
            summary = batch_run.run(enumerate(source, start=1))
        except BaseException as err:
            # What is on disk, for the CLI's line on Ctrl-C / SIGTERM (cli.py).
            err.batchgen_kept = _kept_note(batch_run.summary, output_path)
            # A snapshot that refused or failed a write is not tried again for the last ones.
            snapshot_failed = isinstance(err, (SnapshotTakenOverError, SnapshotWriteError))
            try:
                writer.close(finished=False, snapshot=not snapshot_failed)
            except Exception as close_err:  # the engine's exception is the one to report
                logger.warning("could not store the last results in the snapshot: %s", close_err)
            raise
        writer.close(finished=True)
        if on_complete is not None:
            on_complete()
        note_prefix_cache(summary, engine)
        summary.restored = restored
        summary.ignored = ignored
        summary.dropped_errors = dropped
    if batch_run.blank.count:
        logger.warning(
            "%s: skipped %s between requests (a batch file holds one request per line)",
            input_path,
            batch_run.blank.describe(),
        )
    batch_run.models.warn(logger, str(input_path))
    return summary


def _kept_note(summary: BatchRunSummary, output_path: Path) -> str:
    """``"N results written by this run (M from before) in OUT"`` for a run stopped midway."""
    written = summary.succeeded + summary.failed
    before = f" ({summary.skipped} from before)" if summary.skipped else ""
    noun = "result" if written == 1 else "results"
    return f"{written} {noun} written by this run{before} in {output_path}"
