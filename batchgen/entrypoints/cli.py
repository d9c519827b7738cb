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

User errors (missing input file, invalid setting, an occupied make-model --out) print one line
``batchgen <command>: error: ...`` to stderr and exit with code 2, without a traceback; a flag
the subcommand does not know prints that subcommand's usage first, as argparse does for its own
errors. Heavy modules (torch, the engine) are imported only by the subcommand that needs them,
so ``batchgen --help`` is instant; before one is, the OpenMP wait policy is set
(`batchgen.engine.cpu_threads`), which OpenMP reads only once, when torch loads it.
Signals during ``batchgen run`` (the orderly stop: exit 130, 143 or 129, and a signal once the
work is done changing nothing) are `batchgen.entrypoints.cli_signals`'s.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

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
from batchgen.entrypoints.cli_signals import (  # noqa: F401  (Terminated: re-exported)
    OrderlyStop,
    Terminated,
    say,
    stop_line,
)

LOG_LEVEL_ENV = "BATCHGEN_LOG_LEVEL"  # the "batchgen" logger's level on stderr (default INFO)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# ---------------------------------------------------------------------------------------------
# batchgen make-model


def _add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    from batchgen.models.model_config import SUPPORTED_MAKE_ARCHS  # no torch: --help stays fast

    parser.add_argument(
        "--arch",
        required=True,
        choices=SUPPORTED_MAKE_ARCHS,
        metavar="ARCH",
        help=f"architecture, one of: {', '.join(SUPPORTED_MAKE_ARCHS)}",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="directory to write the checkpoint to (created if missing; refused when it holds "
        "checkpoint files that make-model did not write, unless --overwrite)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the checkpoint files already in --out (config.json, model.safetensors, "
        "the tokenizer's files)",
    )


def _make_model(args: argparse.Namespace) -> int:
    from batchgen.models.make_model import CHECKPOINT_FILES, MADE_BY_FILE, make_model

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {args.out!r} is a file; name a directory for the checkpoint")
    present = [name for name in CHECKPOINT_FILES if os.path.lexists(out / name)]
    # An earlier make-model output (random weights) is replaced, so the README's commands run
    # twice; a checkpoint from elsewhere is not, without --overwrite.
    if present and not args.overwrite and not (out / MADE_BY_FILE).is_file():
        raise CliError(
            f"--out {args.out!r} already holds {', '.join(present)} (a checkpoint?), which "
            "make-model would replace: name another directory, or pass --overwrite"
        )
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
    2: usage or user error; 130: interrupted (SIGINT, Ctrl-C), 143: terminated (SIGTERM), 129:
    hung up (SIGHUP, the terminal closed), in each case after the results finished so far are
    written (rerun with ``--resume``); a signal once every result is written changes nothing.
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


def _run_command(command: Subcommand, args: argparse.Namespace, process_entry: bool = False) -> int:
    """Runs one subcommand; returns its exit code (2 for a `CliError`; for ``batchgen run``
    stopped by a signal, 128 + its number: 130 interrupted (SIGINT), 143 terminated (SIGTERM,
    what ``kill``, ``timeout`` and container runtimes send), 129 hung up (SIGHUP), each the
    same orderly stop, which a second signal does not break into; `cli_signals.OrderlyStop`).
    The handlers go in before anything else runs; once the command's work is done
    (`cli_signals.work_done`) a signal is only noted and the command's code stands.
    ``process_entry`` (the ``batchgen`` script, ``python -m batchgen``): a signal after the
    command finished exits with its code (`cli_signals.exit_now`); in-process callers get
    their handlers back instead."""
    stop = OrderlyStop()
    given_as = GIVEN_AS.set("flag")  # settings over a cluster file are named as flags
    # A --retry-failed run stopped before it dropped the error lines (while the model loads)
    # still has them: --resume alone would not run their lines.
    flag = "--retry-failed" if getattr(args, "retry_failed", False) else "--resume"
    hint = f" (rerun with {flag} to continue)" if command.name == "run" else ""
    code = 1  # an exception that escapes below
    try:
        if command.name == "run" and threading.current_thread() is threading.main_thread():
            stop.install()  # first: a signal during the start-up below stops in order too
        if command.uses_torch:
            from batchgen.engine.cpu_threads import set_openmp_wait_policy

            set_openmp_wait_policy()
        code = command.run(args)
        stop.finish()
    except CliError as err:
        stop.finish()
        say(f"{PROG} {command.name}: error: {err}")
        code = 2
    except KeyboardInterrupt as err:  # `Terminated` included
        sig = stop.exit_signal(err)
        # What `run_batch_file` kept on disk ("" when stopped before it wrote results).
        kept = getattr(err, "batchgen_kept", "")
        say(stop_line(command.name, sig, kept, hint))
        code = 128 + sig
    finally:
        try:
            if late := stop.late_line(command.name, code):
                say(late)
        finally:
            stop.uninstall(code, process_entry)
            GIVEN_AS.reset(given_as)
    return code


if __name__ == "__main__":
    sys.exit(main())
