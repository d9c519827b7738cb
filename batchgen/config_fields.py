"""What the config dataclasses (`EngineConfig`, `ParallelConfig`) share: field metadata and the
type checks their ``validate()`` uses.

A field's metadata says everything the surfaces built from it need: ``help`` (the flag's and
the docs' one-line meaning), ``short`` (a short flag, as vLLM's ``-dp``) and ``section`` (where
it sits in the cluster YAML, `batchgen.cluster_config`; without one it sits in its class's
default section). The CLI flags, ``LLM(...)`` arguments, the YAML schema and the schema table
in docs/cluster-config.md all come from the fields, so a new setting is one field.
"""

from __future__ import annotations

# Cluster YAML sections (`batchgen_cluster.<section>.<field>`); TOP_LEVEL: directly under
# `batchgen_cluster` (the model).
TOP_LEVEL = ""
SECTIONS = ("engine", "parallelism", "coroutine_scheduler", "checkpoint_service")


def meta(help: str, *, section: str | None = None, short: str | None = None) -> dict:
    """A field's metadata: its help text, and where given its YAML section and short flag."""
    if section is not None and section != TOP_LEVEL and section not in SECTIONS:
        raise ValueError(f"unknown cluster YAML section {section!r}; one of {SECTIONS}")
    out: dict = {"help": help}
    if section is not None:
        out["section"] = section
    if short is not None:
        out["short"] = short
    return out


def is_int(value: object) -> bool:
    """An int and not a bool (``True`` is an int to Python, not to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float, not a bool, not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
