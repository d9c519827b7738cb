"""``batchgen serve`` and ``batchgen submit``: their arguments and runs, and the API key both
take (``--api-key``, ``--api-key-file`` or ``$BATCHGEN_API_KEY``: `api_key`).

``serve`` starts the engine (`batchgen.entrypoints.cli_flags.start_engine`) and the HTTP
service over it (`batchgen.service.server.run_server`); ``submit`` loads no model: it sends a
batch file to a server with `batchgen.service.client.BatchGenClient` and writes the results.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from batchgen.entrypoints import cli_flags
from batchgen.entrypoints.cli_flags import PROG, CliError, add_engine_arguments, engine_kwargs

# ---------------------------------------------------------------------------------------------
# API keys (serve, submit)


def _add_api_key_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"{what} (default: $BATCHGEN_API_KEY). Other local users can read a key given "
        "here in /proc/PID/cmdline (ps): prefer $BATCHGEN_API_KEY or --api-key-file",
    )
    keys.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from this file (its first line; keep it mode 0600)",
    )


def api_key(args: argparse.Namespace) -> str | None:
    """The key of --api-key, --api-key-file or $BATCHGEN_API_KEY (in that order); None: none."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        path = Path(args.api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as err:
            raise CliError(f"cannot read --api-key-file: {err}") from err
        key = lines[0].strip() if lines else ""
        if not key:
            raise CliError(f"--api-key-file {str(path)!r} is empty")
        if mode & 0o077:
            logging.getLogger("batchgen").warning(
                "--api-key-file %s is readable by other users (mode %o); chmod 600 it",
                path,
                mode & 0o777,
            )
        return key
    return os.environ.get("BATCHGEN_API_KEY") or None


# ---------------------------------------------------------------------------------------------
# batchgen serve


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``batchgen serve``'s flags (``MODEL``, ``--host``, ``--port``...) and engine flags."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model directory or hub id, as in `vllm serve MODEL` (the same as --model)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine)"
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    parser.add_argument(
        "--state-dir",
        default="batchgen-state",
        metavar="DIR",
        help="job store: SQLite database and files (default: ./batchgen-state)",
    )
    _add_api_key_arguments(
        parser, "require 'Authorization: Bearer KEY' on every route but /health and /metrics"
    )
    parser.add_argument(
        "--max-upload-mb",
        type=float,
        default=200.0,
        metavar="MB",
        help="largest upload or request body, in MB of 10^6 bytes (default: 200)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        metavar="N",
        help="most requests in the engine at once, shared by all batches (default: the "
        "engine's running-sequence limit, --max-num-seqs: 1024 with the coalesce policy, 256 "
        "with lockstep)",
    )
    add_engine_arguments(parser)


def serve(args: argparse.Namespace) -> int:
    """Run ``batchgen serve`` until interrupted. Returns 0.

    Raises:
        CliError: an invalid flag, the model given twice, missing service dependencies, an
            engine that cannot start, a port that cannot be bound.
    """
    if args.model_tag is not None:
        if getattr(args, "model", args.model_tag) != args.model_tag:
            raise CliError(
                f"the model is given twice, as {args.model_tag!r} and --model {args.model!r}; "
                "give one"
            )
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    if not args.max_upload_mb > 0:
        raise CliError(f"--max-upload-mb must be > 0, got {args.max_upload_mb}")
    if args.max_in_flight is not None and args.max_in_flight < 1:
        raise CliError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    try:
        from batchgen.service.app import ServiceConfig
        from batchgen.service.server import run_server
    except ImportError as err:
        raise CliError(f"the service needs its dependencies ({err}); pip install batchgen") from err
    config = ServiceConfig(
        state_dir=Path(args.state_dir),
        api_key=api_key(args),
        max_upload_bytes=int(args.max_upload_mb * 1_000_000),
        max_in_flight=args.max_in_flight,
    )
    engine = cli_flags.start_engine(engine_kwargs(args))
    try:
        run_server(engine, config, host=args.host, port=args.port)
    except OSError as err:
        raise CliError(str(err)) from err
    finally:
        cli_flags.shutdown_engine(engine)
    return 0


# ---------------------------------------------------------------------------------------------
# batchgen submit


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``batchgen submit``'s flags (``-i``, ``-o``, ``--endpoint``, the API key...)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("-i", "--input", help="OpenAI Batch API input (JSONL)")
    source.add_argument(
        "--batch-id",
        action="append",
        metavar="ID",
        help="collect the results of a batch already on the server instead of starting one "
        "(repeat for several: an interrupted submit prints its batches' ids); every result "
        "of the batch is written again from its first",
    )
    parser.add_argument(
        "-o", "--output", required=True, help="results (JSONL, in the order they finish)"
    )
    parser.add_argument(
        "--endpoint",
        default="http://127.0.0.1:8000",
        metavar="URL",
        help="the server (default: http://127.0.0.1:8000)",
    )
    _add_api_key_arguments(parser, "the server's API key")
    parser.add_argument(
        "--completion-window", default="24h", help="batch completion window (default: 24h)"
    )
    parser.add_argument(
        "--retry-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="keep retrying an unreachable server this many seconds (default: 120)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def submit(args: argparse.Namespace) -> int:
    """Run ``batchgen submit``: start one batch per endpoint of ``--input``, or attach to the
    batches ``--batch-id`` names (e.g. after an interrupted submit), and write every result
    to ``--output`` as it arrives. Returns 0 when every batch completed, else 1.

    Raises:
        CliError: a missing input or output directory, a server error (`BatchGenError`: an
            unknown batch id is its 404).
    """
    from tqdm import tqdm

    from batchgen.entrypoints.openai_protocol import dumps_line
    from batchgen.service.client import BatchGenClient, BatchGenError

    if args.input is not None and not Path(args.input).is_file():
        raise CliError(f"input file {args.input!r} does not exist")
    out_dir = Path(args.output).resolve().parent
    if not out_dir.is_dir():
        raise CliError(f"output directory {str(out_dir)!r} does not exist")
    jobs: list = []
    ok = failed = 0
    try:
        with (
            BatchGenClient(
                args.endpoint, api_key=api_key(args), retry_timeout=args.retry_timeout
            ) as client,
            open(args.output, "w", encoding="utf-8") as sink,
            tqdm(unit="req", disable=args.no_progress, file=sys.stderr) as bar,
        ):
            if args.batch_id:
                jobs = [client.batch(batch_id) for batch_id in args.batch_id]
            else:
                jobs = client.submit_file_by_endpoint(
                    args.input, completion_window=args.completion_window
                )
            for job in jobs:
                print(f"{PROG} submit: batch {job.id} ({job.batch['endpoint']})", file=sys.stderr)
            statuses = []
            for job in jobs:
                for result in job.iter_results():
                    sink.write(dumps_line(result.result) + "\n")
                    sink.flush()
                    ok, failed = ok + result.ok, failed + (not result.ok)
                    bar.update(1)
                statuses.append(job.refresh()["status"])
    except BatchGenError as err:
        raise CliError(str(err)) from err
    except KeyboardInterrupt:
        for job in jobs:
            print(f"{PROG} submit: batch {job.id} keeps running on the server", file=sys.stderr)
        if jobs:
            ids = " ".join(f"--batch-id {job.id}" for job in jobs)
            print(
                f"{PROG} submit: to collect its results: {PROG} submit {ids} "
                f"-o {shlex.quote(args.output)} --endpoint {args.endpoint}",
                file=sys.stderr,
            )
        raise
    summary = ", ".join(f"batch {job.id} {status}" for job, status in zip(jobs, statuses))
    print(
        f"{PROG} submit: {summary}: {ok} ok, {failed} failed; results in {args.output}",
        file=sys.stderr,
    )
    return 0 if all(status == "completed" for status in statuses) else 1
