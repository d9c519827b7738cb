"""The ``batchgen`` command line: ``batchgen run``, ``batchgen make-model``.

Each subcommand is a `Subcommand` in `SUBCOMMANDS` (its name, help, how to add its arguments,
and the function that runs it); ``serve`` and ``bench`` are added there the same way.

Engine flags (``--max-num-seqs``, ``--dtype``...) are generated from `EngineConfig`'s fields
and their ``metadata["help"]``, so they follow the config without edits here.

User errors (missing input file, invalid setting, unknown architecture) print one line
``batchgen <command>: error: ...`` to stderr and exit with code 2, without a traceback.
Heavy modules (torch, the engine) are imported only by the subcommand that needs them, so
``batchgen --help`` is instant.
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

from batchgen.config import EngineConfig

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
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


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


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one ``--field-name`` flag per `EngineConfig` field (absent flags keep the default)."""
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind = _flag_type(hints[f.name])
        default = "" if f.default is None else f" (default: {f.default})"
        kwargs: dict = {"dest": f.name, "default": argparse.SUPPRESS}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            metavar = {int: "N", float: "X"}.get(kind, f.name.upper())
            kwargs.update(type=kind, metavar=metavar)
        group.add_argument(
            "--" + f.name.replace("_", "-"), help=f.metadata.get("help", "") + default, **kwargs
        )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `EngineConfig` fields given on the command line."""
    return {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}


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
        default=1024,
        metavar="N",
        help="most requests in the engine at once (default: 1024)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_arguments(parser)


def _check_run_paths(args: argparse.Namespace) -> None:
    if not Path(args.input).is_file():
        raise CliError(f"input file {args.input!r} does not exist")
    out_dir = Path(args.output).resolve().parent
    if not out_dir.is_dir():
        raise CliError(f"output directory {str(out_dir)!r} does not exist")
    if args.max_in_flight < 1:
        raise CliError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")


def _start_engine(kwargs: dict):
    """Build the engine; settings and model-loading problems become `CliError`."""
    from batchgen.entrypoints.llm import LLM
    from batchgen.models.default_model import default_model_path

    try:
        if kwargs.get("model") is None:
            kwargs["model"] = default_model_path()
        return LLM(**kwargs).llm_engine
    except (ValueError, OSError) as err:
        raise CliError(f"cannot start the engine: {err}") from err


def _run(args: argparse.Namespace) -> int:
    from batchgen.entrypoints.batch_runner import BatchFileError, run_batch_file

    _check_run_paths(args)
    engine = _start_engine(engine_kwargs(args))
    try:
        summary = run_batch_file(
            engine,
            args.input,
            args.output,
            resume=args.resume,
            max_in_flight=args.max_in_flight,
            progress=not args.no_progress,
        )
    except (BatchFileError, FileNotFoundError, PermissionError, IsADirectoryError) as err:
        raise CliError(str(err)) from err
    print(f"{PROG} run: {summary.describe()}; results in {args.output}", file=sys.stderr)
    return 0


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


SUBCOMMANDS: list[Subcommand] = [
    Subcommand(
        "run",
        "run an OpenAI Batch API file (JSONL) through the engine",
        _add_run_arguments,
        _run,
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
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_subcommand=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``batchgen`` script. Returns the exit code.

    0: done (individual requests may still have failed: see the output file and summary);
    2: usage or user error; 130: interrupted (rerun with ``--resume`` to continue).
    """
    args = build_parser().parse_args(argv)
    command: Subcommand = args._subcommand
    # Start-up facts (model, device, KV cache blocks/tokens) go to stderr beside the progress bar.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("batchgen")
    root.addHandler(handler)
    root.setLevel(os.environ.get("BATCHGEN_LOG_LEVEL", "INFO").upper())
    try:
        return command.run(args)
    except CliError as err:
        print(f"{PROG} {command.name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = " (rerun with --resume to continue)" if command.name == "run" else ""
        print(f"{PROG} {command.name}: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
