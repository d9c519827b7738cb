"""The cluster file (``batchgen_cluster:``): loading it and validating it, stage by stage.

The schema is derived from the config dataclasses (`batchgen.cluster_schema`): a new engine
flag is a new YAML key without a second edit. Two keys differ from their flags:

- ``world_size`` (top level, optional): the job's ranks; checked, when given, against
  ``data_parallel_size x expert_parallel_size``.
- ``parallelism.data_parallel_size`` counts *replicas*: independent expert-parallel groups of
  ``expert_parallel_size`` ranks, each holding all routed experts (the seed's 8 x 16 = 128).
  On the command line and in ``LLM(...)``, ``data_parallel_size`` keeps vLLM's meaning, *ranks*.
  A file's ``data_parallel_size: D, expert_parallel_size: E`` is therefore the flags
  ``--data-parallel-size D*E --expert-parallel-size E``; `ClusterConfig.kwargs` holds the
  file in that (flag) form, and `batchgen.distributed.layout.resolve_layout` makes the grid.

Validation runs in stages and stops after the first that fails, reporting every problem of
that stage as ``file:line: batchgen_cluster.section.key: what``: YAML syntax; the file's shape
(a mapping with the one root key, no duplicate keys); keys and types (pydantic, strict: ``"16"``
is not an integer; unknown keys list the allowed ones and the closest); sizes (the arithmetic);
the values (the dataclasses' own ``validate()``, every refused value reported). Aliases of YAML
anchors are checked on the node graph before anything expands them (`MAX_YAML_VALUES`, no
recursive anchor). Nothing here loads a model.

Flags and ``LLM`` arguments go over the file with `ClusterConfig.merge` (key by key; the two
names of the running-sequence limit count as one key), which says which keys of the file they
replace; `ClusterConfig.explain` says where each setting of an invalid combination comes from.

Here: `load_cluster_config` and the stages 3-5 (keys and types, sizes, values). The rest, each
in its module and importable from here too: the schema (`batchgen.cluster_schema`), the YAML
and the file's shape, its key lines and error format (`batchgen.cluster_yaml`), the loaded file
and the flags over it (`batchgen.cluster_merge`).
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ValidationError

# Re-exported: importable from here as before these moved to their own modules.
from batchgen.cluster_merge import ClusterConfig, mentions
from batchgen.cluster_schema import (
    DEFAULT_SECTION,
    EXAMPLE,
    ROOT,
    WORLD_HELP,
    YAML_MEANING,
    SchemaKey,
    cluster_model,
    schema_keys,
    schema_markdown,
    type_text,
)
from batchgen.cluster_yaml import (
    MAX_FILE_CHARS,
    MAX_YAML_VALUES,
    ClusterConfigError,
    ClusterFileReader,
    yaml_type,
)
from batchgen.config import EngineConfig
from batchgen.config_fields import SECTIONS, TOP_LEVEL, close_name
from batchgen.distributed.layout import resolve_layout
from batchgen.parallel_config import MAX_RANKS, ParallelConfig

__all__ = [
    "DEFAULT_SECTION",
    "EXAMPLE",
    "MAX_FILE_CHARS",
    "MAX_YAML_VALUES",
    "ROOT",
    "WORLD_HELP",
    "YAML_MEANING",
    "ClusterConfig",
    "ClusterConfigError",
    "SchemaKey",
    "load_cluster_config",
    "schema_keys",
    "schema_markdown",
]


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster file; loads no model and starts nothing.

    Raises:
        ClusterConfigError: (a `ValueError`) the file is unreadable, not YAML, not of the
            schema (`schema_keys`), or its sizes or values are inconsistent; the message names
            the file, line and full key path of every problem of the first failing stage.
    """
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ClusterConfigError(path, [f"{path}: cannot read the cluster file: {err}"]) from None
    return _Loader(path).load(text)


class _Loader(ClusterFileReader):
    """One file's validation stages (module docstring); each failing stage raises. Stages 1-2
    (YAML, the file's shape) are `ClusterFileReader`'s."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.keys = schema_keys()

    def load(self, text: str) -> ClusterConfig:
        cluster = self.check_types(self.parse(text))
        return self.build(cluster, *self.check_sizes(cluster))

    # ---- stage 3: keys and types
    def check_types(self, cluster: dict) -> BaseModel:
        try:
            validated = cluster_model().model_validate(cluster)
        except ValidationError as err:
            self.fail(*(self.type_error(e) for e in err.errors()))
        if validated.model is None:
            given = (ROOT, "model") in self.lines  # `model:` with no value
            self.fail_at(
                (ROOT, "model") if given else (ROOT,),
                f"{'empty' if given else 'missing `model`'}: the cluster file must name the "
                "model, an HF checkpoint directory or hub id",
            )
        if not validated.model.strip():
            self.fail_at((ROOT, "model"), "must be a non-empty string")
        return validated

    def type_error(self, e: dict) -> str:
        loc = (ROOT, *e["loc"])
        value = e.get("input")
        if e["type"] == "extra_forbidden":
            parent = loc[1] if len(loc) == 3 else TOP_LEVEL
            allowed = [k.name for k in self.keys if k.section == parent]
            allowed += list(SECTIONS) if parent == TOP_LEVEL else []
            close = close_name(str(loc[-1]), allowed)
            hint = f"did you mean {close!r}? " if close else ""
            return self.error(loc, f"unknown key; {hint}allowed: {', '.join(allowed)}")
        if e["type"] == "invalid_key":  # loc ends with the key; the line is the key's
            what = f"a key must be a string, got {value!r} ({yaml_type(value)})"
            return self.error(loc[:-1], what, self.line_of(loc))
        if len(loc) == 2 and loc[1] in SECTIONS:
            return self.error(loc, f"expected a mapping of settings, got {yaml_type(value)}")
        key = next((k for k in self.keys if k.loc == loc), None)
        expected = type_text(key.annotation) if key else e["msg"]
        return self.error(loc, f"expected {expected}, got {value!r} ({yaml_type(value)})")

    # ---- stage 4: sizes
    def check_sizes(self, cluster: BaseModel) -> tuple[dict, dict]:
        """The file's world_size, replicas and ranks per group as the flags' kwargs:
        ``data_parallel_size`` (ranks) and ``expert_parallel_size``, where the file sets them,
        and the keys each comes from (`ClusterConfig.sources`)."""
        par = cluster.parallelism
        w, ws = cluster.world_size, (ROOT, "world_size")
        d = par.data_parallel_size if par else None
        e = par.expert_parallel_size if par else None
        sizes = (ws, w), ((ROOT, "parallelism", "data_parallel_size"), d)
        sizes += (((ROOT, "parallelism", "expert_parallel_size"), e),)
        bad = [
            self.error(loc, f"must be >= 1, got {v}") for loc, v in sizes if v is not None and v < 1
        ]
        bad += [
            self.error(loc, f"{v} is more than {MAX_RANKS} ranks, the most a job may have")
            for loc, v in sizes
            if v is not None and v > MAX_RANKS
        ]
        if bad:
            self.fail(*bad)
        if d is not None and e is not None and w is None and d * e > MAX_RANKS:
            self.fail_at(
                sizes[1][0],
                f"{d} replicas x parallelism.expert_parallel_size {e} = {d * e} ranks is more than "
                f"{MAX_RANKS}, the most a job may have",
            )
        ranks = w
        if d is not None and e is not None:
            if w is not None and w != d * e:
                self.fail_at(
                    ws,
                    f"{w} does not match parallelism.data_parallel_size x parallelism."
                    f"expert_parallel_size = {d} x {e} = {d * e} (world_size = replicas x "
                    "ranks per expert-parallel group)",
                )
            ranks = d * e
        elif d is not None or e is not None:
            ranks = w if w is not None else d or e
            size, per = (d, "ranks per expert-parallel group") if d else (e, "replicas")
            if ranks % size:
                key = "data_parallel_size" if d else "expert_parallel_size"
                self.fail_at(
                    ws,
                    f"{w} is not a multiple of parallelism.{key} = {size}: {w} / {size} = "
                    f"{w / size:.4g} {per} (world_size = data_parallel_size x "
                    "expert_parallel_size)",
                )
            e = e if e is not None else ranks // d
        local = par.data_parallel_size_local if par else None
        if local is not None and ranks is not None and local > ranks:
            loc = (ROOT, "parallelism", "data_parallel_size_local")
            self.fail_at(loc, f"{local} is more than the job's {ranks} ranks (world_size)")
        given = {loc: self.source(loc, v) for loc, v in sizes if v is not None}
        dp_loc, ep_loc = sizes[1][0], sizes[2][0]
        out, sources = {}, {}
        if ranks is not None:
            out["data_parallel_size"] = ranks
            from_keys = [given[k] for k in (ws, dp_loc) if k in given]
            sources["data_parallel_size"] = tuple(from_keys or [given[ep_loc]])
        if e is not None:
            out["expert_parallel_size"] = e
            keys = (ep_loc,) if ep_loc in given else (ws, dp_loc)  # e = world / replicas
            from_keys = [given[k] for k in keys if k in given]
            sources["expert_parallel_size"] = tuple(from_keys)
        return out, sources

    # ---- stage 5: values, through the dataclasses
    def build(self, cluster: BaseModel, sizes: dict, sources: dict) -> ClusterConfig:
        kwargs: dict = {"model": cluster.model, **sizes}
        sources = {"model": (self.source((ROOT, "model"), cluster.model),), **sources}
        for key in self.keys:
            section = getattr(cluster, key.section) if key.section else cluster
            if key.owner is None or key.name in kwargs or section is None:
                continue
            if key.name in section.model_fields_set:
                kwargs[key.name] = getattr(section, key.name)
                sources[key.name] = (self.source(key.loc, kwargs[key.name]),)
        configs, errors = {}, []
        for cls in (EngineConfig, ParallelConfig):
            mine = {k: v for k, v in kwargs.items() if k in cls.field_names()}
            # validate() stops at its first problem: set that key aside (its default is
            # valid) and validate again, so that every bad value is reported at once.
            while cls not in configs:
                try:
                    configs[cls] = cls(**mine)
                except ValueError as err:
                    key = self.key_of(cls, err)
                    errors.append(self.value_error(key, err, sources))
                    if key is None or key.name not in mine or key.name in sizes:
                        break
                    del mine[key.name]
        if errors:
            self.fail(*errors)
        parallel = configs[ParallelConfig]
        layout = resolve_layout(parallel)
        return ClusterConfig(self.path, kwargs, configs[EngineConfig], parallel, layout, sources)

    def key_of(self, cls: type, err: ValueError) -> SchemaKey | None:
        """The key whose field a dataclass's message starts with."""
        name = re.match(r"\w+", str(err))
        return next((k for k in self.keys if k.owner is cls and name and k.name == name[0]), None)

    def value_error(self, key: SchemaKey | None, err: ValueError, sources: dict) -> str:
        """A dataclass's message (it starts with the field's name) under the key's full path,
        with the lines of the other keys it names."""
        text = str(err)
        others = [
            f"{n}: {', '.join(f'{p} (line {line})' for p, line, _ in sources[n])}"
            for n in sorted(
                (n for n in sources if n != "model" and (key is None or n != key.name)),
                key=lambda n: mentions(text, n) or 0,
            )
            if mentions(text, n)
        ]
        text += f" ({'; '.join(others)})" if others else ""
        if key is None:
            return self.error((ROOT,), text)
        return self.error(key.loc, text.removeprefix(key.name + " "))
