"""The flags every engine-running ``batchgen`` subcommand shares, and the engine they start.

* `Subcommand`: one ``batchgen <name>`` (its name, help, arguments and run function);
  `CliError`: a user error (one line on stderr, exit code 2); `PROG`.
* `add_engine_arguments`: ``--config FILE`` and one ``--field-name`` flag per `EngineConfig`
  and `ParallelConfig` field, generated from the fields and their ``metadata["help"]``
  (`add_config_flags`); an absent flag is not set on the namespace (``argparse.SUPPRESS``), so
  `engine_kwargs` holds only the flags given, and those override a cluster file key by key.
* `start_engine` / `shutdown_engine`: the engine of ``run`` and ``serve``. The subcommands call
  them as ``cli_flags.start_engine(...)``, so a test replaces the engine by patching this
  module's attribute.

Imports no torch: the engine's modules load inside `start_engine`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from batchgen.config import EngineConfig, ParallelConfig
from batchgen.entrypoints import vllm_flags
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
        help_text = f.metadata.get("help", "")
        if f.default is not None:
            default = f" (default: {f.default})"
        else:  # unset, unless the help says what that means
            default = "" if "default" in help_text.lower() else " (default: unset)"
        kwargs: dict = {"dest": f.name, "default": argparse.SUPPRESS}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:  # ``--cudagraph-capture-sizes 1 2 4`` (vLLM's)
            (item,) = typing.get_args(kind)
            kwargs.update(type=item, nargs="+", metavar="N")
        elif "choices" in f.metadata:  # argparse names the flag and the values on a bad one
            kwargs.update(type=kind, choices=f.metadata["choices"])
        else:
            metavar = {int: "N", float: "X"}.get(kind, f.name.upper())
            kwargs.update(type=kind, metavar=metavar)
        names = [f.metadata["short"]] if "short" in f.metadata else []  # vLLM's -dp
        group.add_argument(
            *names,
            "--" + f.name.replace("_", "-"),
            help=help_text + default,
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
    """Add ``--config``, one ``--field-name`` flag per `EngineConfig` and `ParallelConfig`
    field (absent flags keep the file's setting or the default), and vLLM's flags without a
    BatchGen setting (`vllm_flags.add_vllm_flags`)."""
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
    vllm_flags.add_vllm_flags(parser)


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
    ``config`` (the cluster file) when given: ``LLM(**engine_kwargs(args))``. Logs one INFO
    line per vLLM flag given that is a no-op here (`vllm_flags.log_accepted`)."""
    vllm_flags.log_accepted(args)
    names = ["config", *EngineConfig.field_names(), *ParallelConfig.field_names()]
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


# ---------------------------------------------------------------------------------------------
# The engine of run and serve


def start_engine(kwargs: dict):
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


def shutdown_engine(engine) -> None:
    """Stop a data-parallel engine's rank processes (a one-process engine has nothing to stop)."""
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()
