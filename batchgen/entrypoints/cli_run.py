"""``batchgen run``: its arguments, the snapshot it opens, and the run itself.

`add_arguments` adds ``-i/-o``, ``--resume``, ``--retry-failed``, ``--max-in-flight``,
``--no-progress`` and the engine flags; `run` checks the paths, locks the output for the
whole run (`batchgen.entrypoints.output_lock`: a second run on it is refused), opens the
``--snapshot-storage-uri`` snapshot (before any model loads, so a mismatched snapshot fails
fast), with ``--resume`` refuses another input's output and stops when every input line
already has its result (`batchgen.entrypoints.batch_resume.check_resume`: nothing to do, no
model loaded), starts the engine without the snapshot settings (`SNAPSHOT_FIELDS`, which
``run`` acts on itself) and streams the file through
`batchgen.entrypoints.batch_runner.run_batch_file`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from batchgen.entrypoints import cli_flags
from batchgen.entrypoints.cli_flags import PROG, CliError, add_engine_arguments, engine_kwargs
from batchgen.entrypoints.cli_signals import say, work_done
from batchgen.models.default_model import DEFAULT_MODEL_NAME, RANDOM_WEIGHTS_NOTE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``batchgen run``'s flags (``-i``, ``-o``, ``--resume``, ``--retry-failed``...) and
    the engine flags."""
    parser.add_argument(
        "-i",
        "--input",
        required=True,
        help="OpenAI Batch API input (JSONL); - reads standard input",
    )
    parser.add_argument("-o", "--output", required=True, help="results (JSONL, completion order)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the results already in the output file and run only the missing requests "
        "(error results count as done; refused when no result is for a request of the input)",
    )
    parser.add_argument(
        "--retry-failed",
        action="store_true",
        help="implies --resume, and also runs again the lines whose result is an error: their "
        "error lines are dropped from the output first (rewritten atomically), so it ends "
        "with one result per line",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        metavar="N",
        help="most requests in the engine at once (default: the engine's running-sequence "
        "limit, --max-num-seqs)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_arguments(parser)


def _check_run_paths(args: argparse.Namespace) -> None:
    if Path(args.input).is_dir():
        raise CliError(f"input file {args.input!r} is a directory; name a batch input file")
    if not Path(args.input).exists():  # a pipe or FIFO (`-i <(zcat in.jsonl.gz)`) is fine
        raise CliError(f"input file {args.input!r} does not exist")
    if Path(args.output).is_dir():
        raise CliError(
            f"output file {args.output!r} is a directory; name a file for the results, "
            f"e.g. {str(Path(args.output) / 'results.jsonl')!r}"
        )
    out_dir = Path(args.output).resolve().parent
    if not out_dir.is_dir():
        raise CliError(f"output directory {str(out_dir)!r} does not exist")
    if Path(args.output).exists() and Path(args.output).samefile(args.input):
        raise CliError(
            f"output file {args.output!r} is the input file {args.input!r} (a link to it, or "
            "the same path): name another file for the results"
        )
    if args.max_in_flight is not None and args.max_in_flight < 1:
        raise CliError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")


# What ``-i -`` reads: standard input by path, so that it goes the way of any other input (a
# pipe: read once, as ``-i <(zcat in.jsonl.gz)``; a redirected file: a regular file).
STDIN_PATH = "/dev/stdin"


def _standard_input(args: argparse.Namespace) -> None:
    """``-i -``: read the batch from standard input (``args.input`` becomes `STDIN_PATH`);
    ``-o -`` is refused: results go to a file, the one ``--resume`` continues."""
    if args.output == "-":
        raise CliError(
            "-o -: results are written to a file (the one --resume continues), not to "
            "standard output; name one, e.g. -o results.jsonl"
        )
    if args.input != "-":
        return
    try:
        terminal = os.isatty(0)
        os.fstat(0)
    except OSError:
        raise CliError(
            "-i -: standard input is closed; pipe the batch in or pass its path"
        ) from None
    if terminal:
        raise CliError(
            "-i -: standard input is a terminal; pipe the batch in (zcat in.jsonl.gz | "
            "batchgen run -i - ...) or pass its path"
        )
    if not os.path.exists(STDIN_PATH):
        raise CliError(f"-i -: this system has no {STDIN_PATH}; pass the input file's path")
    args.input = STDIN_PATH


def _max_running_seqs(engine) -> int:
    """The engine's limit on sequences running at once (`EngineConfig.max_running_seqs`)."""
    return int(getattr(getattr(engine, "config", None), "max_running_seqs", 1024))


# The settings `batchgen run` acts on itself; the engine is started without them.
SNAPSHOT_FIELDS = ("snapshot_storage_uri", "snapshot_interval_results", "snapshot_interval_s")


def _open_snapshot(args: argparse.Namespace, kwargs: dict):
    """The `SnapshotWriter` of ``--snapshot-storage-uri`` (or the cluster file's), its store
    checked against this job; None without one. Loads no model."""
    from batchgen.cluster_config import ClusterConfigError
    from batchgen.entrypoints.llm import make_configs
    from batchgen.entrypoints.snapshot_store import (
        SnapshotError,
        SnapshotStore,
        SnapshotWriter,
        job_manifest,
    )

    try:
        engine_config, parallel = make_configs(**kwargs)
    except ClusterConfigError as err:
        raise CliError(str(err)) from err
    except ValueError as err:
        raise CliError(f"cannot start the engine: {err}") from err
    if parallel.snapshot_storage_uri is None:
        return None
    try:
        store = SnapshotStore(parallel.snapshot_storage_uri)
        store.open_job(job_manifest(args.input, engine_config, parallel))
    except SnapshotError as err:
        raise CliError(str(err)) from err
    except Exception as err:  # unreachable store, missing bucket, refused credentials...
        message = f"cannot use the snapshot at {parallel.snapshot_storage_uri}: {err!r}"
        raise CliError(message) from err
    return SnapshotWriter(
        store,
        max_results=parallel.snapshot_interval_results or SnapshotWriter.DEFAULT_MAX_RESULTS,
        max_age_s=parallel.snapshot_interval_s or SnapshotWriter.DEFAULT_MAX_AGE_S,
    )


def _without_snapshot(kwargs: dict) -> dict:
    """The engine's arguments: ``kwargs`` less the snapshot settings, the cluster file's too."""
    out = {k: v for k, v in kwargs.items() if k not in SNAPSHOT_FIELDS}
    if "config" in kwargs:
        out.update(dict.fromkeys(SNAPSHOT_FIELDS))  # None: the default, over the file's
    return out


def _nothing_left(args: argparse.Namespace, snapshot) -> bool:
    """``--resume``: refuse another input's output and, with ``--retry-failed``, a snapshot
    holding error results or an output that cannot be rewritten (`check_can_rewrite`), before
    the model loads; without a snapshot, when every input line already has its result (a
    successful one with ``--retry-failed``, which then drops the output's other error results
    here), say so: the model is not loaded."""
    from batchgen.entrypoints.batch_input import input_result_keys
    from batchgen.entrypoints.batch_output import BatchFileError
    from batchgen.entrypoints.batch_resume import (
        check_can_rewrite,
        check_resume,
        check_snapshot_for_retry,
        drop_failed_results,
    )

    try:
        check = check_resume(args.input, args.output)
        if args.retry_failed and check is not None and check.error_lines:
            check_can_rewrite(args.output)  # before the model loads, not after
        if args.retry_failed and snapshot is not None:
            check_snapshot_for_retry(snapshot, input_result_keys(args.input)[1])
        if check is None or snapshot is not None or not check.nothing_left(args.retry_failed):
            return False
        dropped = 0
        if args.retry_failed and check.error_lines:  # for lines deleted from the input
            dropped = drop_failed_results(args.output)
            check = check_resume(args.input, args.output)
    except (BatchFileError, PermissionError) as err:
        raise CliError(str(err)) from err
    if check.warning:
        logging.getLogger(__name__).warning(check.warning)
    have, flag = "a result", "--resume"
    if args.retry_failed:
        have, flag = "a successful result", "--retry-failed"
        if dropped:
            flag += f"; dropped its {dropped} other error results"
    elif check.failed:
        flag += f"; {check.failed} of them errors: add --retry-failed to run those again"
    print(
        f"{PROG} run: nothing to do: all {check.requests} requests of {args.input} already have "
        f"{have} in {args.output} ({flag}); the model was not loaded",
        file=sys.stderr,
    )
    return True


def _no_requests(args: argparse.Namespace) -> bool:
    """An input file with no request line (empty, or blank lines only): say so, leave an empty
    output (or, with ``--resume``, the output as it is) and do not load the model. A pipe is
    not looked at: it can be read once only, by the run."""
    if not Path(args.input).is_file():
        return False
    with open(args.input, "rb") as f:
        if any(raw.strip() for raw in f):  # stops at the first request line: no full pass
            return False
    if not args.resume or not Path(args.output).exists():
        Path(args.output).write_bytes(b"")
    print(
        f"{PROG} run: nothing to do: {args.input} has no request lines (an empty file or blank "
        "lines only); the model was not loaded",
        file=sys.stderr,
    )
    return True


def run(args: argparse.Namespace) -> int:
    """Run ``batchgen run``. Returns 0, or 1 when the run stopped early (a rank failed, the
    snapshot was taken over or could not be written; the message says where the results are).
    Marks the work done (`cli_signals.work_done`) once every result is written, or once the
    run has failed, before the engine's ranks shut down: a signal after that changes nothing.
    Holds the output's lock (`output_lock`) from before anything reads or changes the output
    to the end.

    Raises:
        CliError: a missing input, an unusable output or snapshot, another run writing the
            output, an engine that cannot start.
    """
    from batchgen.entrypoints.batch_output import BatchFileError
    from batchgen.entrypoints.output_lock import output_lock

    _standard_input(args)
    _check_run_paths(args)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(output_lock(args.output))
        except BatchFileError as err:  # another run holds it, or its path is a symlink
            raise CliError(str(err)) from err
        return _run_locked(args)


def _run_locked(args: argparse.Namespace) -> int:
    """`run` once the paths are checked and the output is locked."""
    from batchgen.distributed.frontend import RankFailedError
    from batchgen.entrypoints.batch_runner import BatchFileError, run_batch_file
    from batchgen.entrypoints.snapshot_store import SnapshotTakenOverError, SnapshotWriteError

    args.resume = args.resume or args.retry_failed
    kwargs = engine_kwargs(args)
    snapshot = _open_snapshot(args, kwargs)  # a mismatched snapshot fails before the model
    if snapshot is None and _no_requests(args):
        return 0
    if args.resume and _nothing_left(args, snapshot):
        return 0
    engine = cli_flags.start_engine(_without_snapshot(kwargs))
    try:
        summary = run_batch_file(
            engine,
            args.input,
            args.output,
            resume=args.resume,
            retry_failed=args.retry_failed,
            max_in_flight=args.max_in_flight or _max_running_seqs(engine),
            progress=not args.no_progress,
            snapshot=snapshot,
            on_complete=work_done,  # every result written: a signal now changes nothing
        )
    except (SnapshotTakenOverError, SnapshotWriteError) as err:
        work_done()  # the run ends here, with code 1, whatever signal comes now
        # Their messages say where the results are and what to do.
        say(f"{PROG} run: error: {err}")
        return 1
    except (BatchFileError, FileNotFoundError, PermissionError, IsADirectoryError) as err:
        raise CliError(str(err)) from err
    except RankFailedError as err:
        work_done()
        where = f"{args.output}" + (f" and {snapshot.store.uri}" if snapshot else "")
        say(
            f"{PROG} run: error: {err}; every result finished before it is in {where}: "
            "rerun with --resume to finish the rest"
        )
        return 1
    finally:
        cli_flags.shutdown_engine(engine)  # a data-parallel engine's ranks leave
    say(f"{PROG} run: {summary.describe()}; results in {args.output}")
    if getattr(engine, "model_name", None) == f"batchgen/{DEFAULT_MODEL_NAME}":
        say(f"{PROG} run: note: {RANDOM_WEIGHTS_NOTE}")
    return 0
