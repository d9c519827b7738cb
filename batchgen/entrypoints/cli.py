"""The ``batchgen`` command line: ``batchgen run``, ``serve``, ``submit``, ``bench``,
``config``, ``make-model``.

Each subcommand is a `Subcommand` in `SUBCOMMANDS` (its name, help, how to add its arguments,
and the function that runs it); ``bench`` is added there the same way.

Engine flags (``--max-num-seqs``, ``--dtype``...) are generated from `EngineConfig`'s fields
and their ``metadata["help"]``, so they follow the config without edits here. An absent flag is
not set on the namespace (``default=argparse.SUPPRESS``), so `engine_kwargs` holds only the
flags given, and those override a ``--config`` cluster file key by key.

User errors (missing input file, invalid setting, unknown architecture) print one line
``batchgen <command>: error: ...`` to stderr and exit with code 2, without a traceback; a flag
the subcommand does not know prints that subcommand's usage first, as argparse does for its own
errors. Heavy modules (torch, the engine) are imported only by the subcommand that needs them,
so ``batchgen --help`` is instant; before one is, the OpenMP wait policy is set
(`batchgen.engine.cpu_threads`), which OpenMP reads only once, when torch loads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from batchgen import __version__
from batchgen.config import EngineConfig, ParallelConfig
from batchgen.config_fields import GIVEN_AS
from batchgen.models.default_model import DEFAULT_MODEL_NAME, RANDOM_WEIGHTS_NOTE
from batchgen.parallel_config import check_tensor_parallel_size

PROG = "batchgen"


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


@dataclass(frozen=True)
class Subcommand:
    """One ``batchgen <name>`` subcommand.

    Attributes:
        name: the word after ``batchgen``.
        help: one line for ``batchgen --help``.
        add_arguments: adds the subcommand's flags to its parser.
        run: runs it with the parsed arguments; returns the exit code. Raises `CliError` for
            user errors.
        uses_torch: runs torch (the OpenMP settings are made before it loads).
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    uses_torch: bool = True


# ---------------------------------------------------------------------------------------------
# Engine flags from EngineConfig


def _flag_type(annotation: object) -> type:
    """The Python type behind ``T`` or ``T | None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if len(args) != 1:
            raise TypeError(f"cannot make a flag for a field of type {annotation}")
        return args[0]
    return annotation  # type: ignore[return-value]


def add_config_flags(group, config_cls) -> None:
    """One ``--field-name`` flag per field of the dataclass ``config_cls`` (absent flags are not
    set on the namespace, so the dataclass default applies)."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        kind = _flag_type(hints[f.name])
        default = "" if f.default is None else f" (default: {f.default})"
        kwargs: dict = {"dest": f.name, "default": argparse.SUPPRESS}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            metavar = {int: "N", float: "X"}.get(kind, f.name.upper())
            kwargs.update(type=kind, metavar=metavar)
        names = [f.metadata["short"]] if "short" in f.metadata else []  # vLLM's -dp
        group.add_argument(
            *names,
            "--" + f.name.replace("_", "-"),
            help=f.metadata.get("help", "") + default,
            **kwargs,
        )


def add_cluster_file_argument(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` (not set on the namespace when absent)."""
    parser.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="cluster file (batchgen_cluster: YAML, docs/cluster-config.md; check it with "
        "`batchgen config check FILE`); flags given here override its settings. Its "
        "parallelism.data_parallel_size counts replicas, --data-parallel-size counts ranks",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one ``--field-name`` flag per `EngineConfig` and `ParallelConfig`
    field (absent flags keep the file's setting or the default)."""
    add_cluster_file_argument(parser)
    add_config_flags(parser.add_argument_group("engine options"), EngineConfig)
    parallel = parser.add_argument_group(
        "parallel options",
        "Several ranks (processes), each with its own requests and KV cache; vLLM's "
        "`--data-parallel-size N --enable-expert-parallel` is one expert-parallel group of "
        "N ranks here too. See docs/distributed.md.",
    )
    add_config_flags(parallel, ParallelConfig)
    parallel.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=_tensor_parallel_size,
        default=argparse.SUPPRESS,
        metavar="1",
        help="vLLM's flag, accepted at 1 (a no-op); BatchGen has no tensor parallelism: "
        "use --data-parallel-size N --enable-expert-parallel",
    )


def _tensor_parallel_size(text: str) -> int:
    """``--tensor-parallel-size``: 1, else an argparse error naming the flag and the way to use
    several ranks (`check_tensor_parallel_size`)."""
    try:
        value: object = int(text)
    except ValueError:
        value = text
    try:
        check_tensor_parallel_size(value, flag=True)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return 1


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `EngineConfig` and `ParallelConfig` fields given on the command line, and
    ``config`` (the cluster file) when given: ``LLM(**engine_kwargs(args))``."""
    names = ["config", *EngineConfig.field_names(), *ParallelConfig.field_names()]
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


# ---------------------------------------------------------------------------------------------
# batchgen run


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input", required=True, help="OpenAI Batch API input (JSONL)")
    parser.add_argument("-o", "--output", required=True, help="results (JSONL, completion order)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the results already in the output file and run only the missing requests",
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
    if not Path(args.input).is_file():
        raise CliError(f"input file {args.input!r} does not exist")
    out_dir = Path(args.output).resolve().parent
    if not out_dir.is_dir():
        raise CliError(f"output directory {str(out_dir)!r} does not exist")
    if args.max_in_flight is not None and args.max_in_flight < 1:
        raise CliError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")


def _max_running_seqs(engine) -> int:
    """The engine's limit on sequences running at once (`EngineConfig.max_running_seqs`)."""
    return int(getattr(getattr(engine, "config", None), "max_running_seqs", 1024))


def _start_engine(kwargs: dict):
    """Build the engine; cluster-file, settings and model-loading problems become `CliError`."""
    from batchgen.cluster_config import ClusterConfigError
    from batchgen.distributed.frontend import RankFailedError
    from batchgen.entrypoints.llm import LLM

    try:
        # model None: the engine builds the embedded default model on first use and reports
        # it by name (batchgen/<name>) rather than by its cache path.
        return LLM(**kwargs).llm_engine
    except ClusterConfigError as err:  # names the file, line and key already
        raise CliError(str(err)) from err
    except (ValueError, OSError, RankFailedError) as err:
        raise CliError(f"cannot start the engine: {err}") from err


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


def _run(args: argparse.Namespace) -> int:
    from batchgen.distributed.frontend import RankFailedError
    from batchgen.entrypoints.batch_runner import BatchFileError, run_batch_file
    from batchgen.entrypoints.snapshot_store import SnapshotTakenOverError, SnapshotWriteError

    _check_run_paths(args)
    kwargs = engine_kwargs(args)
    snapshot = _open_snapshot(args, kwargs)  # a mismatched snapshot fails before the model
    engine = _start_engine(_without_snapshot(kwargs))
    try:
        summary = run_batch_file(
            engine,
            args.input,
            args.output,
            resume=args.resume,
            max_in_flight=args.max_in_flight or _max_running_seqs(engine),
            progress=not args.no_progress,
            snapshot=snapshot,
        )
    except (SnapshotTakenOverError, SnapshotWriteError) as err:
        # Their messages say where the results are and what to do.
        print(f"{PROG} run: error: {err}", file=sys.stderr)
        return 1
    except (BatchFileError, FileNotFoundError, PermissionError, IsADirectoryError) as err:
        raise CliError(str(err)) from err
    except RankFailedError as err:
        where = f"{args.output}" + (f" and {snapshot.store.uri}" if snapshot else "")
        print(
            f"{PROG} run: error: {err}; every result finished before it is in {where}: "
            "rerun with --resume to finish the rest",
            file=sys.stderr,
        )
        return 1
    finally:
        _shutdown(engine)
    print(f"{PROG} run: {summary.describe()}; results in {args.output}", file=sys.stderr)
    if getattr(engine, "model_name", None) == f"batchgen/{DEFAULT_MODEL_NAME}":
        print(f"{PROG} run: note: {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
    return 0


def _shutdown(engine) -> None:
    """Stop a data-parallel engine's rank processes (a one-process engine has nothing to stop)."""
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()


# ---------------------------------------------------------------------------------------------
# batchgen make-model


def _add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch", required=True, help="architecture, e.g. mixtral (the error lists all)"
    )
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")


def _make_model(args: argparse.Namespace) -> int:
    from batchgen.models.make_model import SUPPORTED_MAKE_ARCHS, make_model

    if args.arch not in SUPPORTED_MAKE_ARCHS:
        raise CliError(f"--arch must be one of {list(SUPPORTED_MAKE_ARCHS)}, got {args.arch!r}")
    try:
        path = make_model(args.arch, args.out, seed=args.seed)
    except (ValueError, OSError) as err:
        raise CliError(str(err)) from err
    print(path)
    return 0


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


def _api_key(args: argparse.Namespace) -> str | None:
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


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
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


def _serve(args: argparse.Namespace) -> int:
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
        api_key=_api_key(args),
        max_upload_bytes=int(args.max_upload_mb * 1_000_000),
        max_in_flight=args.max_in_flight,
    )
    engine = _start_engine(engine_kwargs(args))
    try:
        run_server(engine, config, host=args.host, port=args.port)
    except OSError as err:
        raise CliError(str(err)) from err
    finally:
        _shutdown(engine)
    return 0


# ---------------------------------------------------------------------------------------------
# batchgen submit


def _add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input", required=True, help="OpenAI Batch API input (JSONL)")
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


def _submit(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from batchgen.entrypoints.openai_protocol import dumps_line
    from batchgen.service.client import BatchGenClient, BatchGenError

    if not Path(args.input).is_file():
        raise CliError(f"input file {args.input!r} does not exist")
    out_dir = Path(args.output).resolve().parent
    if not out_dir.is_dir():
        raise CliError(f"output directory {str(out_dir)!r} does not exist")
    jobs: list = []
    ok = failed = 0
    try:
        with (
            BatchGenClient(
                args.endpoint, api_key=_api_key(args), retry_timeout=args.retry_timeout
            ) as client,
            open(args.output, "w", encoding="utf-8") as sink,
            tqdm(unit="req", disable=args.no_progress, file=sys.stderr) as bar,
        ):
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
        raise
    summary = ", ".join(f"batch {job.id} {status}" for job, status in zip(jobs, statuses))
    print(
        f"{PROG} submit: {summary}: {ok} ok, {failed} failed; results in {args.output}",
        file=sys.stderr,
    )
    return 0 if all(status == "completed" for status in statuses) else 1


def _bench_args(parser: argparse.ArgumentParser) -> None:
    from batchgen.bench.args import add_arguments

    add_arguments(parser)


def _bench_module():
    from batchgen.bench import runner

    return runner


def _config_args(parser: argparse.ArgumentParser) -> None:
    from batchgen.entrypoints import config_check

    config_check.add_arguments(parser)


def _config_run(args: argparse.Namespace) -> int:
    from batchgen.entrypoints import config_check

    return config_check.run(args)


SUBCOMMANDS: list[Subcommand] = [
    Subcommand(
        "run",
        "run an OpenAI Batch API file (JSONL) through the engine",
        _add_run_arguments,
        _run,
    ),
    Subcommand(
        "serve",
        "serve the OpenAI Files/Batches and completions API over one engine",
        _add_serve_arguments,
        _serve,
    ),
    Subcommand(
        "submit",
        "submit a batch file to a `batchgen serve` server and download its results",
        _add_submit_arguments,
        _submit,
        uses_torch=False,
    ),
    Subcommand(
        "bench",
        "benchmark transformers generate / generate_batch against BatchGen lockstep / coalesce",
        lambda parser: _bench_args(parser),
        lambda args: _bench_module().run_from_args(args),
    ),
    Subcommand(
        "config",
        "check a cluster file (`config check FILE`: layout or errors, no weights loaded) or "
        "list its keys (`config schema`)",
        _config_args,
        _config_run,
    ),
    Subcommand(
        "make-model",
        "write a tiny random-weight HF checkpoint (for tests and demos)",
        _add_make_model_arguments,
        _make_model,
    ),
]


def build_parser() -> argparse.ArgumentParser:
    """The ``batchgen`` parser with one subparser per entry of `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Throughput-first batch inference for Mixture-of-Experts LLMs."
    )
    parser.add_argument("--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_subcommand=command, _parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``batchgen`` script. Returns the exit code.

    0: done (individual requests may still have failed: see the output file and summary);
    2: usage or user error; 130: interrupted (rerun with ``--resume`` to continue).
    """
    args, unknown = build_parser().parse_known_args(argv)
    command: Subcommand = args._subcommand
    if unknown:  # argparse would report them with the top-level usage, not the subcommand's
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    # Start-up facts (model, device, KV cache blocks/tokens) go to stderr beside the progress bar.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("batchgen")
    root.addHandler(handler)
    root.setLevel(os.environ.get("BATCHGEN_LOG_LEVEL", "INFO").upper())
    if command.uses_torch:
        from batchgen.engine.cpu_threads import set_openmp_wait_policy

        set_openmp_wait_policy()
    given_as = GIVEN_AS.set("flag")  # settings over a cluster file are named as flags
    try:
        return command.run(args)
    except CliError as err:
        print(f"{PROG} {command.name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = " (rerun with --resume to continue)" if command.name == "run" else ""
        print(f"{PROG} {command.name}: interrupted{hint}", file=sys.stderr)
        return 130
    finally:
        GIVEN_AS.reset(given_as)


if __name__ == "__main__":
    sys.exit(main())
