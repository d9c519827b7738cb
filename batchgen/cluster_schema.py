"""The cluster file's schema (``batchgen_cluster:``): its keys, their types and the table of them.

The schema is derived from the config dataclasses: every `EngineConfig` and `ParallelConfig`
field is a key of the section its ``metadata["section"]`` names (`batchgen.config_fields`;
default ``engine`` for `EngineConfig`, ``parallelism`` for `ParallelConfig`), so a new engine
flag is a new YAML key without a second edit. Two keys differ from their flags (``world_size``
and ``parallelism.data_parallel_size``: `batchgen.cluster_config`). `schema_keys` lists the
keys, `cluster_model` is the strict pydantic model that types them, and `schema_markdown`
the table of docs/cluster-config.md and ``batchgen config schema``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, create_model

from batchgen.config import EngineConfig
from batchgen.config_fields import SECTIONS, TOP_LEVEL
from batchgen.parallel_config import ParallelConfig

ROOT = "batchgen_cluster"
EXAMPLE = "examples/cluster.yaml"
DEFAULT_SECTION = {EngineConfig: "engine", ParallelConfig: "parallelism"}
# The one key that is no field: the job's ranks (module docstring).
WORLD_HELP = (
    "the job's ranks; optional: when given it must equal data_parallel_size x "
    "expert_parallel_size (default: that product)"
)
# (help, flag) of the parallelism keys whose meaning in the file is not their flag's.
YAML_MEANING = {
    "data_parallel_size": (
        "replicas: independent expert-parallel groups, each holding all routed experts; "
        "world_size = data_parallel_size x expert_parallel_size (default: world_size / "
        "expert_parallel_size). Not the flag's meaning: --data-parallel-size counts ranks",
        "none: --data-parallel-size counts ranks (world_size)",
    ),
    "expert_parallel_size": (
        "ranks per expert-parallel group (default: world_size / data_parallel_size when both "
        "are given; else all ranks with enable_expert_parallel or decode_strategy "
        "dp_attention_ep_moe, else 1: experts replicated)",
        "--expert-parallel-size",
    ),
}


@dataclass(frozen=True)
class SchemaKey:
    """One key of the cluster file.

    Attributes:
        section: the section under ``batchgen_cluster`` ("" for the top level).
        name: the key, which is also the dataclass field's name.
        owner: `EngineConfig` or `ParallelConfig`; None for ``world_size`` (no field).
        annotation: the value's type, e.g. ``int | None``.
        default: the default when the key is absent.
        help: one line of meaning.
        flag: the command-line flag that sets the same, or a note where none does.
    """

    section: str
    name: str
    owner: type | None
    annotation: object
    default: object
    help: str
    flag: str

    @property
    def loc(self) -> tuple[str, ...]:
        """The key's place in the file: ``("batchgen_cluster", "parallelism", "...")``."""
        return tuple(p for p in (ROOT, self.section, self.name) if p)

    @property
    def path(self) -> str:
        return ".".join(self.loc)


def schema_keys() -> list[SchemaKey]:
    """Every key of the cluster file, top level first, then by section in `SECTIONS` order."""
    keys = []
    for cls in (EngineConfig, ParallelConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            section = f.metadata.get("section", DEFAULT_SECTION[cls])
            flag = "--" + f.name.replace("_", "-")
            help = f.metadata.get("help", "")
            default = f.default
            if cls is ParallelConfig and f.name in YAML_MEANING:
                (help, flag), default = YAML_MEANING[f.name], None
            keys.append(SchemaKey(section, f.name, cls, hints[f.name], default, help, flag))
            if f.name == "model":
                ranks = "--data-parallel-size (ranks)"
                keys.append(SchemaKey("", "world_size", None, int | None, None, WORLD_HELP, ranks))
    order = {s: i for i, s in enumerate((TOP_LEVEL, *SECTIONS))}
    return sorted(keys, key=lambda k: order[k.section])


def cluster_model() -> type[BaseModel]:
    """The pydantic model of the mapping under ``batchgen_cluster`` (strict types, no unknown
    keys), one sub-model per section, built from `schema_keys`."""
    strict = ConfigDict(extra="forbid", strict=True)
    keys = schema_keys()
    sections = {}
    for section in SECTIONS:
        fields = {k.name: (k.annotation, None) for k in keys if k.section == section}
        sections[section] = (
            create_model(f"Cluster_{section}", __config__=strict, **fields) | None,
            None,
        )
    top = {k.name: (k.annotation, None) for k in keys if k.section == TOP_LEVEL}
    return create_model("Cluster", __config__=strict, **top, **sections)


def type_text(annotation: object) -> str:
    """``int | None`` -> "an integer or null"."""
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    names[list[int]] = "a list of integers"
    return " or ".join(names.get(a, "null" if a is type(None) else str(a)) for a in args)


# ---------------------------------------------------------------------------------------------
# The schema as a table (docs/cluster-config.md, `batchgen config schema`)


def schema_markdown() -> str:
    """The Markdown table of every key: YAML key, CLI flag, default, meaning."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def default(key: SchemaKey) -> str:
        if key.default is None:  # `model`: the embedded model as a flag, required in the file
            return "see meaning" if "default" in key.help else "unset"
        if isinstance(key.default, bool):
            return f"`{str(key.default).lower()}`"
        return f"`{key.default!r}`" if isinstance(key.default, str) else f"`{key.default}`"

    rows = ["| YAML key | CLI flag | default | meaning |", "| --- | --- | --- | --- |"]
    for key in schema_keys():
        name = key.path.removeprefix(ROOT + ".")
        flag = re.sub(r"(--[\w-]+)", r"`\1`", key.flag)
        rows.append(f"| `{name}` | {cell(flag)} | {default(key)} | {cell(key.help)} |")
    return "\n".join(rows) + "\n"
