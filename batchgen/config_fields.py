"""What the config dataclasses (`EngineConfig`, `ParallelConfig`) share: field metadata and the
type checks their ``validate()`` uses.

A field's metadata says everything the surfaces built from it need: ``help`` (the flag's and
the docs' one-line meaning), ``short`` (a short flag, as vLLM's ``-dp``) and ``section`` (where
it sits in the cluster YAML, `batchgen.cluster_config`; without one it sits in its class's
default section). The CLI flags, ``LLM(...)`` arguments, the YAML schema and the schema table
in docs/cluster-config.md all come from the fields, so a new setting is one field.
"""

from __future__ import annotations

import contextvars
import difflib
from collections.abc import Iterable

# Cluster YAML sections (`batchgen_cluster.<section>.<field>`); TOP_LEVEL: directly under
# `batchgen_cluster` (the model).
TOP_LEVEL = ""
SECTIONS = ("engine", "parallelism", "coroutine_scheduler", "checkpoint_service")


# How messages name a value given over a cluster file: "flag" (``--max-num-seqs 512``; the
# ``batchgen`` command line sets it while a subcommand runs) or "argument"
# (``max_num_seqs=512``, as ``LLM(...)`` takes it).
GIVEN_AS: contextvars.ContextVar[str] = contextvars.ContextVar(
    "batchgen_given_as", default="argument"
)


def given_text(name: str, value: object) -> str:
    """A setting as the user gave it: ``--max-num-seqs 512`` / ``--no-enable-expert-parallel``
    on the command line (`GIVEN_AS` "flag"), else ``max_num_seqs=512``."""
    if GIVEN_AS.get() != "flag":
        return f"{name}={value!r}"
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


def meta(
    help: str,
    *,
    section: str | None = None,
    short: str | None = None,
    choices: tuple[str, ...] | None = None,
) -> dict:
    """A field's metadata: its help text, and where given its YAML section, short flag and
    allowed values (``choices``: the flag refuses any other value as a usage error, before
    anything loads)."""
    if section is not None and section != TOP_LEVEL and section not in SECTIONS:
        raise ValueError(f"unknown cluster YAML section {section!r}; one of {SECTIONS}")
    out: dict = {"help": help}
    if section is not None:
        out["section"] = section
    if short is not None:
        out["short"] = short
    if choices is not None:
        out["choices"] = choices
    return out


def is_int(value: object) -> bool:
    """An int and not a bool (``True`` is an int to Python, not to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float, not a bool, not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def close_name(name: str, known: Iterable[str]) -> str | None:
    """The name of ``known`` closest to a misspelt ``name`` (`difflib`, its default cutoff
    0.6), or None: ``close_name("max_num_seq", fields)`` is ``"max_num_seqs"``. For the
    "did you mean" of every unknown name (LLM arguments, request fields, cluster YAML keys)."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return close[0] if close else None
