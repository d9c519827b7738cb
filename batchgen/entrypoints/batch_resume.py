"""``batchgen run --resume`` and ``--retry-failed``: what an existing output file holds for this
input, and what a resumed run keeps of it.

* `prepare_resume`: read the output (`scan_results_file`), refuse an output whose results are
  all for another input (`check_not_foreign`), warn about some, cut a half-written last line,
  and with ``retry_failed`` drop the error results so that their lines run again
  (`drop_failed_results`).
* `check_resume`: the same reading for the CLI before it loads the model: how many requests
  are missing or failed (``nothing to do`` when none is left).
* `check_snapshot_for_retry`: ``--retry-failed`` with a snapshot holding error results is
  refused: its segments are written once and never changed, so it would restore them.

**Dropping error results atomically.** The output is rewritten without its error lines into
``.<name>.retry-failed.tmp`` beside it (created anew: whatever that path held is removed, a
symlink there never followed; fsync'ed, the file's owner and mode kept), which is then renamed
over it (atomic on POSIX) and the directory fsync'ed; only then does the run append. A process
killed before the rename leaves the output as it was (and at most that temporary, which the
next ``--retry-failed`` overwrites); killed after it, the output holds every success and no
error line, and the new results follow as they finish. No moment holds two results for one
custom_id or lacks a success. The rename replaces the path's file: a symlinked output has its
target rewritten (the link stays), a hard link to the output keeps the old content.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from batchgen.entrypoints.batch_input import input_result_keys
from batchgen.entrypoints.batch_output import (
    BatchFileError,
    ResumeState,
    is_failed_result,
    scan_results_file,
    truncate_partial_last_line,
)
from batchgen.entrypoints.output_lock import sidecar_path
from batchgen.entrypoints.snapshot_store import SnapshotWriter

logger = logging.getLogger(__name__)


def _sample(state: ResumeState) -> str:
    more = state.foreign - len(state.foreign_sample)
    return ", ".join(state.foreign_sample) + (f" and {more} more" if more > 0 else "")


def check_not_foreign(state: ResumeState, input_path: os.PathLike, output_path: os.PathLike):
    """Refuse an output none of whose results is for a request of the input (another input's
    output named by mistake: resuming would append to it).

    Args:
        state: the output's results, scanned with the input's keys (`scan_results_file`).

    Raises:
        BatchFileError: ``state`` has results and every one is foreign; the message names both
            files and the first few foreign custom_ids.
    """
    if state.num_results and state.foreign == state.num_results:
        raise BatchFileError(
            f"cannot resume: none of the {state.num_results} results in {output_path} is for a "
            f"request of {input_path} (custom_ids {_sample(state)}); is it another input's "
            "output? Name another -o, or move the file away to start over"
        )


def foreign_warning(
    state: ResumeState, input_path: os.PathLike, output_path: os.PathLike
) -> str | None:
    """The warning for an output some of whose results are for no request of the input (lines
    deleted from the input since), or None when there are none."""
    if not state.foreign:
        return None
    return (
        f"{output_path}: {state.foreign} of its {state.num_results} results are for no request "
        f"of {input_path} (custom_ids {_sample(state)}); they stay in the output (lines "
        "deleted from the input?)"
    )


def _fsync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (a no-op where directories cannot be fsync'ed)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _rewrite_error(output_path: str | os.PathLike, tmp: Path, err: OSError) -> BatchFileError:
    return BatchFileError(
        f"--retry-failed rewrites {output_path} into {tmp.name} beside it and renames that "
        f"over it, which failed: {err.strerror or err} (a directory that is not writable?); "
        "the output is unchanged. Run with --resume only, or copy the output to a writable "
        "directory"
    )


def retry_temporary(output_path: str | os.PathLike) -> Path:
    """The temporary `drop_failed_results` writes: ``.<name>.retry-failed.tmp`` beside the
    file ``output_path`` names (`sidecar_path`: a hash for a name too long for it)."""
    return sidecar_path(output_path, ".retry-failed.tmp")


def _copy_owner_and_mode(source: int, target: int) -> None:
    """Give the rewritten output the old file's owner and mode: a ``--retry-failed`` run as
    root must not leave a user's output owned by root, which that user could then not append
    to. The owner is kept where the process may set it (root, or the owner keeping a group
    of theirs); the mode is set after it (chown clears setuid bits)."""
    old = os.fstat(source)
    with contextlib.suppress(PermissionError):
        os.fchown(target, old.st_uid, old.st_gid)
    os.fchmod(target, stat.S_IMODE(old.st_mode))


def _create_temporary(tmp: Path):
    """Open a new, empty ``tmp`` for writing. Whatever was at that path is removed first, not
    written through: a symlink left there (to the output itself, say) is never followed.

    Raises:
        OSError: it cannot be removed or created.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return open(os.open(tmp, flags, 0o600), "wb")


def check_can_rewrite(output_path: str | os.PathLike) -> None:
    """Check that `drop_failed_results` can create its temporary (before a model loads).

    Raises:
        BatchFileError: it cannot; the message says why and what to do.
    """
    tmp = retry_temporary(output_path)
    try:
        with _create_temporary(tmp):
            pass
        os.unlink(tmp)
    except OSError as err:
        raise _rewrite_error(output_path, tmp, err) from err


def drop_failed_results(output_path: str | os.PathLike) -> int:
    """Rewrite ``output_path`` without its error results (`is_failed_result`), atomically
    (module docstring): every success line is kept, byte for byte and in order; blank lines
    and a half-written last line are left out.

    Returns:
        The number of error lines dropped (0: the file is left untouched).

    Raises:
        BatchFileError: the output is not a regular file (a pipe or a device cannot be
            rewritten), or the temporary could not be written or renamed (the output is
            unchanged then).
    """
    path = Path(os.path.realpath(output_path))  # a symlink keeps pointing at the new file
    if not path.is_file():
        raise BatchFileError(
            f"--retry-failed rewrites the output without its error results, but {output_path} "
            "is not a regular file"
        )
    tmp = retry_temporary(path)
    dropped = 0
    try:
        with open(path, "rb") as source, _create_temporary(tmp) as target:
            for raw in source:
                if not raw.endswith(b"\n"):
                    break  # half-written by a killed run
                if not raw.strip():
                    continue
                if is_failed_result(json.loads(raw)):
                    dropped += 1
                else:
                    target.write(raw)
            if dropped:
                target.flush()
                _copy_owner_and_mode(source.fileno(), target.fileno())
                os.fsync(target.fileno())
        if dropped:
            os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise _rewrite_error(output_path, tmp, err) from err
        raise
    if not dropped:
        os.unlink(tmp)
        return 0
    _fsync_directory(path.parent)
    return dropped


def check_snapshot_for_retry(snapshot: SnapshotWriter, expected: ResumeState) -> None:
    """Refuse ``--retry-failed`` when the snapshot holds an error result for this input.

    A snapshot's segments are written once and never changed, so it cannot drop those results:
    the run would copy them back into the output and not run their lines. A snapshot without
    error results (a new URI, say) works with ``--retry-failed``: the output's successes are
    stored there and the failed lines run. Reads every segment once.

    Raises:
        BatchFileError: the snapshot holds error results for requests in ``expected``; the
            message says how many and what to do.
    """
    failed = 0
    for line in snapshot.store.iter_result_lines():
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict) and is_failed_result(result) and expected.has(result):
            failed += 1
    if failed:
        raise BatchFileError(
            f"--retry-failed: the snapshot at {snapshot.store.uri} holds {failed} error results "
            "for this input, and a snapshot's results are never changed, so it would restore "
            "them instead of running their lines again. Rerun with --retry-failed and a new "
            "--snapshot-storage-uri (the output's successful results are stored there first), "
            "or without --retry-failed"
        )


def check_resumable_output(output_path: str | os.PathLike) -> None:
    """Refuse to resume into a pipe or socket: its results cannot be read back (opening a FIFO
    to read them would wait for a writer forever).

    Raises:
        BatchFileError: ``output_path`` is a FIFO or a socket.
    """
    mode = os.stat(output_path).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise BatchFileError(
            f"--resume reads the results already in the output, but {output_path} is a pipe; "
            "name a file for the results, or run without --resume"
        )


def prepare_resume(
    input_path: Path,
    output_path: Path,
    expected: ResumeState | None,
    *,
    retry_failed: bool,
) -> tuple[ResumeState, int]:
    """What a resumed run keeps of an existing ``output_path`` (call only when it exists).

    Reads the output, refuses it when every result is for another input (`check_not_foreign`,
    nothing changed then), cuts a half-written last line, with ``retry_failed`` drops every
    error result from the file (`drop_failed_results`; those for no request of the input too)
    so that their lines run again, and warns about the results left that are for no request
    of the input.

    Args:
        expected: the input's result keys (`input_result_keys`); None for an input that can be
            read once only (a pipe): no foreign check then.

    Returns:
        (the results kept, the number of error lines dropped).

    Raises:
        BatchFileError: a pipe (`check_resumable_output`), not a result file
            (`scan_results_file`), another input's output, or errors to drop from an output
            that is not a regular file.
    """
    check_resumable_output(output_path)
    state = scan_results_file(output_path, expected)
    if expected is not None:
        check_not_foreign(state, input_path, output_path)
    truncate_partial_last_line(output_path)
    dropped = 0
    if retry_failed and state.num_failed_lines:
        dropped = drop_failed_results(output_path)
        logger.info("%s: dropped %d error results to run their lines again", output_path, dropped)
        state = scan_results_file(output_path, expected)  # what stays: the successes
    warning = foreign_warning(state, input_path, output_path) if expected is not None else None
    if warning:
        logger.warning(warning)
    return state, dropped


@dataclass
class ResumeCheck:
    """What an existing output holds for an input (`check_resume`).

    Attributes:
        requests: request lines of the input.
        missing: those without any result in the output.
        failed: those whose result is an error (`is_failed_result`).
        error_lines: error results in the output (those of ``failed``, those for no request
            of the input, and any beside a success for the same request).
        warning: `foreign_warning`'s text, or None.
    """

    requests: int
    missing: int
    failed: int
    error_lines: int
    warning: str | None

    def nothing_left(self, retry_failed: bool) -> bool:
        """Whether a resumed run (``--retry-failed`` or not) would run no request."""
        return self.missing == 0 and not (retry_failed and self.failed)


def check_resume(
    input_path: str | os.PathLike, output_path: str | os.PathLike
) -> ResumeCheck | None:
    """For ``batchgen run --resume`` before the model loads: what ``output_path`` holds for
    ``input_path``, by the keys `run_batch_file` resumes by (`input_result_keys`,
    `result_key`).

    None when the output does not exist, is the input, or the input is not a regular file (a
    pipe can be read once only). Like a resumed run, cuts a half-written last output line.

    Raises:
        BatchFileError: the output is a pipe (`check_resumable_output`), not a batch result
            file, or another input's (`check_not_foreign`).
    """
    if not os.path.exists(output_path):
        return None
    check_resumable_output(output_path)
    if not stat.S_ISREG(os.stat(input_path).st_mode):
        return None
    if os.path.samefile(input_path, output_path):
        return None  # `run_batch_file` reports it
    count, keys = input_result_keys(input_path)
    state = scan_results_file(output_path, keys)
    check_not_foreign(state, input_path, output_path)
    truncate_partial_last_line(output_path)
    missing = len(keys.done_ids - state.done_ids) + len(keys.done_lines - state.done_lines)
    failed = sum(1 for key in state.failed if keys.has_key(key))
    warning = foreign_warning(state, input_path, output_path)
    return ResumeCheck(count, missing, failed, state.num_failed_lines, warning)
