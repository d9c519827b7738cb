"""The ``batchgen`` command line: ``batchgen run``, ``serve``, ``submit``, ``bench``,
``config``, ``make-model``.

Each subcommand is a `Subcommand` in `SUBCOMMANDS` (its name, help, how to add its arguments,
and the function that runs it); ``bench`` is added there the same way. This module keeps
`build_parser`, `main` and ``make-model``; ``run`` is in `batchgen.entrypoints.cli_run`,
``serve`` and ``submit`` in `batchgen.entrypoints.cli_service`, the shared flag machinery
(`Subcommand`, `CliError`, `add_engine_arguments`, `engine_kwargs`, `start_engine`) in
`batchgen.entrypoints.cli_flags`; their public names are re-exported here.

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
import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from batchgen import __version__
from batchgen.config_fields import GIVEN_AS
from batchgen.entrypoints import cli_run, cli_service
from batchgen.entrypoints.cli_flags import (  # noqa: F401  (re-exported)
    PROG,
    CliError,
    Subcommand,
    add_cluster_file_argument,
    add_config_flags,
    add_engine_arguments,
    engine_kwargs,
)
from batchgen.entrypoints.cli_run import SNAPSHOT_FIELDS  # noqa: F401  (re-exported)
from batchgen.entrypoints.cli_service import api_key as _api_key  # noqa: F401  (re-exported)

LOG_LEVEL_ENV = "BATCHGEN_LOG_LEVEL"  # the "batchgen" logger's level on stderr (default INFO)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

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
        cli_run.add_arguments,
        cli_run.run,
    ),
    Subcommand(
        "serve",
        "serve the OpenAI Files/Batches and completions API over one engine",
        cli_service.add_serve_arguments,
        cli_service.serve,
    ),
    Subcommand(
        "submit",
        "submit a batch file to a `batchgen serve` server and download its results",
        cli_service.add_submit_arguments,
        cli_service.submit,
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
    2: usage or user error; 130: interrupted (SIGINT, Ctrl-C), 143: terminated (SIGTERM), in
    both cases after the results finished so far are written (rerun with ``--resume``).
    """
    args, unknown = build_parser().parse_known_args(argv)
    command: Subcommand = args._subcommand
    if unknown:  # argparse would report them with the top-level usage, not the subcommand's
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    raw_level = os.environ.get(LOG_LEVEL_ENV, "")
    level = raw_level.strip().upper() or "INFO"
    if level not in LOG_LEVELS:
        allowed = ", ".join(LOG_LEVELS)
        print(
            f"{PROG} {command.name}: error: {LOG_LEVEL_ENV}={raw_level!r}: expected one of "
            f"{allowed} (any case)",
            file=sys.stderr,
        )
        return 2
    # Start-up facts (model, device, KV cache blocks/tokens) go to stderr beside the progress bar.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("batchgen")
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(level)
    try:
        return _run_command(command, args, process_entry=argv is None)
    finally:
        # In-process callers (tests, notebooks) get the logger back as it was: no handler
        # left on a closed stream, no level that outlives the command.
        root.removeHandler(handler)
        root.setLevel(previous_level)


class Terminated(KeyboardInterrupt):
    """SIGTERM during a command: unwinds like Ctrl-C (the results finished so far are written,
    the engine and its ranks shut down), then the command exits 143 (128 + SIGTERM)."""


def _exit_now(code: int):
    """A signal handler for after the command has finished: the process exits at once with
    the command's own exit code (a finished job stays a success) instead of dying of the
    signal, or printing a KeyboardInterrupt traceback, while the interpreter shuts down."""

    def handler(signum, frame) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    return handler


class _OrderlyStop:
    """SIGINT and SIGTERM during `batchgen run`. The first one raises (`KeyboardInterrupt`, or
    `Terminated` for SIGTERM) and so starts the orderly stop: the results finished so far are
    written, the engine and its ranks shut down. A later one is only noted: raised inside that
    stop it would cut it short (a traceback, the kept-results line lost, the wrong exit code);
    SIGKILL still stops the process at once. A SIGTERM among them makes the stop exit 143 (two
    signals that land during one long step reach Python together, SIGINT first).

    A signal ignored on entry (SIG_IGN from the parent) stays ignored, as Python leaves an
    ignored SIGINT and POSIX shells an ignored trap; a SIGINT handler other than Python's own
    is left alone."""

    def __init__(self) -> None:
        self.received: set[int] = set()
        self.previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            current = signal.getsignal(sig)
            if current is signal.SIG_IGN or (
                sig == signal.SIGINT and current is not signal.default_int_handler
            ):
                continue
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        first = not self.received
        self.received.add(signum)
        if first:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    def terminated(self, err: BaseException) -> bool:
        return isinstance(err, Terminated) or signal.SIGTERM in self.received

    def uninstall(self, code: int, process_entry: bool) -> None:
        """After the command: the ``batchgen`` script exits at once with ``code`` on either
        signal (`_exit_now`), and ignores them once the interpreter exits (which puts Python's
        handlers back to SIG_DFL before it tears down the modules: a signal then killed the
        process, exit -2 or -15, not ``code``); in-process callers get their handlers back."""
        for sig, previous in self.previous.items():
            if process_entry:
                signal.signal(sig, _exit_now(code))
            else:  # None: a handler from outside Python, which only SIG_DFL can stand for
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        if process_entry and self.previous:
            atexit.register(_ignore_signals, list(self.previous))


def _ignore_signals(signals: list[int]) -> None:
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def _run_command(
    command: Subcommand, args: argparse.Namespace, process_entry: bool = False
) -> int:
    """Runs one subcommand; returns its exit code (2 for a `CliError`, 130 when interrupted,
    143 when terminated: `batchgen run` turns SIGTERM, what ``kill``, ``timeout`` and container
    runtimes send, into the same orderly stop as Ctrl-C, and a second signal does not break
    into that stop (`_OrderlyStop`)). ``process_entry`` (the ``batchgen`` script, ``python -m
    batchgen``): a signal after the command finished exits with its code (`_exit_now`);
    in-process callers get their handlers back instead."""
    if command.uses_torch:
        from batchgen.engine.cpu_threads import set_openmp_wait_policy

        set_openmp_wait_policy()
    given_as = GIVEN_AS.set("flag")  # settings over a cluster file are named as flags
    stop = _OrderlyStop()
    if command.name == "run" and threading.current_thread() is threading.main_thread():
        stop.install()
    # A --retry-failed run stopped before it dropped the error lines (while the model loads)
    # still has them: --resume alone would not run their lines.
    flag = "--retry-failed" if getattr(args, "retry_failed", False) else "--resume"
    hint = f" (rerun with {flag} to continue)" if command.name == "run" else ""
    code = 1  # an exception that escapes below
    try:
        code = command.run(args)
    except CliError as err:
        print(f"{PROG} {command.name}: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt as err:  # `Terminated` included
        # What `run_batch_file` kept on disk ("" when stopped before it wrote results).
        kept = getattr(err, "batchgen_kept", "")
        terminated = stop.terminated(err)
        how = "terminated by SIGTERM" if terminated else "interrupted"
        print(f"{PROG} {command.name}: {how}{'; ' + kept if kept else ''}{hint}", file=sys.stderr)
        code = 143 if terminated else 130
    finally:
        stop.uninstall(code, process_entry)
        GIVEN_AS.reset(given_as)
    return code


if __name__ == "__main__":
    sys.exit(main())
