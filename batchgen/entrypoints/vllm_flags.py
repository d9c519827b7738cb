"""vLLM's engine flags that BatchGen has no setting for, and what each one does here.

A vLLM command line (``vllm serve MODEL --trust-remote-code --enable-chunked-prefill``) carried
over to ``batchgen run`` or ``batchgen serve`` should either run or say why not, never stop at
argparse's bare "unrecognized arguments". Each `VllmFlag` of `VLLM_FLAGS` is one flag with one
of two outcomes:

* accepted, a no-op: BatchGen already behaves as the flag asks (chunked prefill is always on,
  nothing is swapped to CPU). The command logs one INFO line saying so and runs. A flag that
  takes a value is a no-op only at the values that match BatchGen (``--max-logprobs 20``,
  ``--tokenizer-mode auto``); any other value is refused.
* refused: a usage error (exit 2) before anything loads, naming the flag, why BatchGen does not
  take it and what to do instead (``--quantization``: not supported yet).

The vLLM flags BatchGen has as settings of its own (``--enforce-eager``,
``--max-num-batched-tokens``, ``--gpu-memory-utilization``...) are `EngineConfig` fields, and
``--tensor-parallel-size`` is handled beside them (`batchgen.entrypoints.cli_flags`).
docs/batch-files.md ("Engine flags") has the same table for readers.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Where the parser keeps the no-ops given, as (flag, reason), for `log_accepted`.
ACCEPTED_DEST = "_vllm_noops"


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag without a BatchGen setting.

    Attributes:
        names: its option strings, the long one first (``("--quantization", "-q")``).
        reason: what BatchGen does instead, one clause (the INFO line of an accepted use, the
            error of a refused one).
        metavar: the value's name; None: a switch, given without a value.
        noop: True: every use is a no-op; False: every use is refused; a value: the one value
            that is a no-op (compared as an integer when it is one: ``--max-logprobs 020``).
        instead: what to do instead, for a refused use ("" when ``reason`` says it).
    """

    names: tuple[str, ...]
    reason: str
    metavar: str | None = None
    noop: bool | str = False
    instead: str = ""

    @property
    def flag(self) -> str:
        return self.names[0]

    def accepts(self, value: str | None) -> bool:
        """Whether a use (its value; None for a switch) is a no-op."""
        if isinstance(self.noop, bool):
            return self.noop
        if self.noop.isdigit():
            try:
                return int(value or "") == int(self.noop)
            except ValueError:
                return False
        return value == self.noop

    def refusal(self, value: str | None, as_kwarg: bool = False) -> str:
        """The error of a refused use (argparse puts ``argument --flag: `` in front);
        ``as_kwarg``: written as the `LLM` argument (``quantization='fp8'``)."""
        if as_kwarg:
            name = self.kwarg
            noop = int(self.noop) if isinstance(self.noop, str) and self.noop.isdigit() else self.noop
            shown, accepted = f"{name}={value!r}", f"{name}={noop!r}"
        else:
            shown = self.flag + ("" if value is None else f" {value}")
            accepted = f"{self.flag} {self.noop}"
        only = f" (accepted only as {accepted})" if isinstance(self.noop, str) else ""
        tail = f"; {self.instead}" if self.instead else ""
        return f"vLLM's {shown} is not taken by BatchGen: {self.reason}{only}{tail}"

    @property
    def kwarg(self) -> str:
        """Its name as an `LLM` keyword argument (``trust_remote_code``)."""
        return self.flag.removeprefix("--").replace("-", "_")

    def help(self) -> str:
        """The flag's ``--help`` line."""
        if isinstance(self.noop, bool):
            verdict = "no-op" if self.noop else "refused"
        else:
            verdict = f"no-op as {self.flag} {self.noop}, else refused"
        return f"{verdict}: {self.reason}"


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(
        ("--trust-remote-code",),
        "each supported architecture runs BatchGen's own implementation (docs/models.md), "
        "never Python code shipped with a checkpoint",
        noop=True,
    ),
    VllmFlag(
        ("--enable-chunked-prefill",),
        "prefill is always chunked (a step takes at most --max-num-batched-tokens tokens)",
        noop=True,
    ),
    VllmFlag(
        ("--no-enable-chunked-prefill",),
        "prefill is always chunked",
        instead="to prefill each prompt in one step, set --max-num-batched-tokens to at least "
        "the longest prompt",
    ),
    VllmFlag(
        ("--disable-log-stats",),
        "no periodic engine stats are logged (batchgen serve's counters are at /metrics)",
        noop=True,
    ),
    VllmFlag(("--disable-log-requests",), "no line is logged per request", noop=True),
    VllmFlag(
        ("--swap-space",),
        "a preempted sequence is recomputed, as in vLLM V1: nothing is swapped to CPU memory",
        metavar="GiB",
        noop=True,
    ),
    VllmFlag(
        ("--max-logprobs",),
        "a request's logprobs and prompt_logprobs are capped at 20 (vLLM's default), a fixed limit",
        metavar="N",
        noop="20",
        instead="drop the flag",
    ),
    VllmFlag(
        ("--tokenizer-mode",),
        "the tokenizer loads as with vLLM's 'auto' (transformers' AutoTokenizer, "
        "the fast one where the checkpoint has tokenizer.json)",
        metavar="MODE",
        noop="auto",
        instead="drop the flag",
    ),
    VllmFlag(
        ("--revision",),
        "a hub id is loaded at its main branch, through the Hugging Face cache",
        metavar="REV",
        noop="main",
        instead="download that revision (`hf download MODEL --revision REV --local-dir DIR`) "
        "and pass --model DIR",
    ),
    VllmFlag(
        ("--download-dir",),
        "hub downloads go to the Hugging Face cache",
        metavar="DIR",
        instead="set HF_HUB_CACHE=DIR (or HF_HOME) to choose where, or pass a checkpoint "
        "directory as --model",
    ),
    VllmFlag(
        ("--quantization", "-q"),
        "quantized weights are not supported yet (float32, bfloat16 or float16 weights: "
        "--dtype; a quantized checkpoint is refused as it loads)",
        metavar="METHOD",
        instead="use an unquantized checkpoint; --kv-cache-dtype fp8 makes the KV cache smaller",
    ),
    VllmFlag(
        ("--pipeline-parallel-size", "-pp"),
        "there is no pipeline parallelism",
        metavar="N",
        noop="1",
        instead="several ranks are --data-parallel-size N --enable-expert-parallel "
        "(docs/distributed.md)",
    ),
)


class _VllmFlagAction(argparse.Action):
    """Accepts a no-op use (noted under `ACCEPTED_DEST`) or refuses it (a usage error)."""

    def __init__(self, option_strings, dest, entry: VllmFlag, **kwargs) -> None:
        self.entry = entry
        nargs = 0 if entry.metavar is None else None
        super().__init__(option_strings, dest, nargs=nargs, metavar=entry.metavar, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = None if self.entry.metavar is None else values
        if not self.entry.accepts(value):
            raise argparse.ArgumentError(self, self.entry.refusal(value))
        given = self.entry.flag + ("" if value is None else f" {value}")
        noted = list(getattr(namespace, ACCEPTED_DEST, []))
        setattr(namespace, ACCEPTED_DEST, [*noted, (given, self.entry.reason)])


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add `VLLM_FLAGS` to ``parser``, in a help group of their own. They set nothing on the
    namespace but `ACCEPTED_DEST` (the no-ops given, for `log_accepted`)."""
    group = parser.add_argument_group(
        "vLLM flags without a BatchGen setting",
        "Accepted as no-ops where BatchGen already does what they ask, else refused with the "
        "reason (docs/batch-files.md, 'Engine flags').",
    )
    for entry in VLLM_FLAGS:
        group.add_argument(
            *entry.names,
            action=_VllmFlagAction,
            entry=entry,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            help=entry.help(),
        )


def log_accepted(args: argparse.Namespace) -> None:
    """Log one INFO line per vLLM flag of ``args`` accepted as a no-op."""
    for given, reason in getattr(args, ACCEPTED_DEST, []):
        logger.info("%s: vLLM's flag, accepted with no effect: %s", given, reason)


def take_vllm_kwargs(kwargs: dict) -> dict:
    """`VLLM_FLAGS` as `LLM` keyword arguments (vLLM's ``LLM(model, trust_remote_code=True,
    quantization=None, ...)``): the rest of ``kwargs``, without them. A switch given as False
    or an argument given as None is vLLM's default and passes silently; a no-op use logs one
    INFO line, as on the command line.

    Raises:
        ValueError: a refused use, naming the argument, why and what to do instead.
    """
    rest = dict(kwargs)
    by_name = {entry.kwarg: entry for entry in VLLM_FLAGS if not entry.flag.startswith("--no-")}
    for name, entry in by_name.items():
        if name not in rest:
            continue
        value = rest.pop(name)
        negated = [e for e in VLLM_FLAGS if e.kwarg == f"no_{name}"]
        if value is False and negated:  # enable_chunked_prefill=False: --no-enable-chunked-...
            (no,) = negated
            raise ValueError(
                f"LLM argument: vLLM's {name}=False is not taken by BatchGen: {no.reason}; "
                f"{no.instead}"
            )
        if value is None or value is False:
            continue
        if entry.metavar is None and value is not True:
            raise ValueError(f"LLM argument {name} must be True or False, got {value!r}")
        if not entry.accepts(None if entry.metavar is None else str(value)):
            raise ValueError(f"LLM argument: {entry.refusal(value, as_kwarg=True)}")
        logger.info(
            "%s=%r: vLLM's argument, accepted with no effect: %s", name, value, entry.reason
        )
    return rest
