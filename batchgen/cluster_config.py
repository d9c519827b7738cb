"""The cluster file (``batchgen_cluster:``): its schema, loading and validation, in one place.

The schema is derived from the config dataclasses: every `EngineConfig` and `ParallelConfig`
field is a key of the section its ``metadata["section"]`` names (`batchgen.config_fields`;
default ``engine`` for `EngineConfig`, ``parallelism`` for `ParallelConfig`), so a new engine
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
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from batchgen.config import ALIASES, EngineConfig
from batchgen.config_fields import SECTIONS, TOP_LEVEL, given_text
from batchgen.distributed.layout import ParallelLayout, resolve_layout
from batchgen.parallel_config import MAX_RANKS, ParallelConfig

ROOT = "batchgen_cluster"
EXAMPLE = "examples/cluster.yaml"
# Bounds on what a file may make YAML build (a cluster file has a few dozen values): its size,
# and the values it expands to, aliases of anchors counted once per use (a 1 KB file of nested
# aliases expands to billions: "billion laughs").
MAX_FILE_CHARS = 1 << 20
MAX_YAML_VALUES = 10_000
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


# ---------------------------------------------------------------------------------------------
# The loaded file


@dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster file.

    Attributes:
        path: the file.
        kwargs: the `EngineConfig` and `ParallelConfig` fields the file sets, as ``LLM(...)``
            and the flags take them (``data_parallel_size`` in ranks); command-line flags and
            ``LLM`` keyword arguments override them key by key.
        engine, parallel: the file's settings with every other field at its default.
        layout: the rank grid of ``parallel``.
    """

    path: str
    kwargs: dict
    engine: EngineConfig
    parallel: ParallelConfig
    layout: ParallelLayout
    # kwargs name -> the file's keys it comes from, each (key path, line, value as written):
    # ``data_parallel_size`` (ranks) from ``world_size`` and ``parallelism.data_parallel_size``.
    sources: dict[str, tuple[tuple[str, int | None, object], ...]] = dataclasses.field(
        default_factory=dict
    )

    def origin(self, name: str) -> str:
        """Where the file sets ``kwargs[name]``: ``batchgen_cluster.world_size: 2 at f.yaml:3``."""
        return ", ".join(
            f"{key}: {value!r} at {self.path}" + (f":{line}" if line else "")
            for key, line, value in self.sources.get(name, ())
        )

    def merge(self, given: dict) -> tuple[dict, list[str]]:
        """The file's `kwargs` with ``given`` (flags or ``LLM`` arguments) over them, key by key,
        and one sentence per setting given that replaces keys of the file.

        Two names of one setting (`batchgen.config.ALIASES`: ``max_num_seqs`` and
        ``max_active_coroutines``) are one key: either given replaces the file's value of
        either. ``enable_expert_parallel=False`` given (``--no-enable-expert-parallel``) turns
        expert parallelism off, as in vLLM: the file's ``expert_parallel_size`` > 1 and
        ``decode_strategy: dp_attention_ep_moe`` give way too, unless also given.
        """
        merged = dict(self.kwargs)
        replaced: dict[str, list[str]] = {}
        for name in given:
            same = [n for n in (name, *ALIASES.get(name, ())) if n in self.kwargs]
            replaced[name] = same
            for n in same:
                merged.pop(n, None)
        if given.get("enable_expert_parallel") is False:
            for name, shards in (
                ("expert_parallel_size", lambda v: v is not None and v > 1),
                ("decode_strategy", lambda v: v == "dp_attention_ep_moe"),
            ):
                if name not in given and shards(merged.get(name)):
                    del merged[name]
                    replaced["enable_expert_parallel"].append(name)
        merged.update(given)
        notes = []
        for name, names in replaced.items():
            if names and given[name] is not None:  # None: the default, not a user's setting
                note = f"{given_text(name, given[name])} overrides "
                note += ", ".join(self.origin(n) for n in names)
                if name == "enable_expert_parallel" and not given[name]:
                    note += ": the experts are replicated on every rank"
                notes.append(note)
        return merged, notes

    def explain(self, err: ValueError, given: dict, merged: dict) -> ClusterConfigError:
        """``err`` of the settings `merge` made (``merged``), with where each setting it names
        comes from: the file's key and line, or the flag (``LLM`` argument) given."""
        text = str(err)
        named = [n for n in merged if n != "model" and _mentions(text, n)]
        named = [n for n in named if n in given or n in self.sources]
        named.sort(key=lambda n: _mentions(text, n))
        parts = [
            f"{n} from {given_text(n, given[n])}" if n in given else f"{n} from {self.origin(n)}"
            for n in named
        ]
        if not parts:
            return ClusterConfigError(self.path, [f"{self.path} with the settings given: {text}"])
        return ClusterConfigError(self.path, [f"{text} ({'; '.join(parts)})"])

    def flags(self) -> list[str]:
        """The command line that sets the same as the file (``--model M --data-parallel-size
        128 ...``)."""
        out: list[str] = []
        for name, value in self.kwargs.items():
            flag = "--" + name.replace("_", "-")
            if value is None:  # `key: null` is the default: no flag
                continue
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            else:
                out += [flag, str(value)]
        return out


class ClusterConfigError(ValueError):
    """A cluster file that cannot be used. ``errors``: one line per problem, each
    ``file[:line]: batchgen_cluster.key.path: what is wrong``."""

    def __init__(self, path: str, errors: list[str]) -> None:
        self.path, self.errors = path, errors
        if len(errors) == 1:
            message = errors[0]
        else:
            message = f"{path}: {len(errors)} errors:\n" + "\n".join("  " + e for e in errors)
        super().__init__(message)


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


class _Loader:
    """One file's validation stages (module docstring); each failing stage raises."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lines: dict[tuple, int] = {}  # key path -> line of the key (1-based)
        self.keys = schema_keys()

    def error(self, loc: tuple, what: str, line: int | None = None) -> str:
        """``file:line: batchgen_cluster.a.b: what``, with the line of the deepest known key."""
        for i in range(len(loc), 0, -1):
            line = line or self.line_of(loc[:i])
        where = f"{self.path}:{line}" if line else self.path
        key = ".".join(str(p) for p in loc)
        return f"{where}: {key}: {what}" if key else f"{where}: {what}"

    def fail(self, *errors: str) -> typing.NoReturn:
        raise ClusterConfigError(self.path, list(errors))

    def fail_at(self, loc: tuple, what: str, line: int | None = None) -> typing.NoReturn:
        self.fail(self.error(loc, what, line))

    def load(self, text: str) -> ClusterConfig:
        cluster = self.check_types(self.parse(text))
        return self.build(cluster, *self.check_sizes(cluster))

    # ---- stages 1-2: YAML and the file's shape
    def parse(self, text: str) -> dict:
        example = f"it needs the root key `{ROOT}:` (see {EXAMPLE})"
        if len(text) > MAX_FILE_CHARS:
            what = f"{len(text)} characters, more than a cluster file needs (at most "
            self.fail_at((), what + f"{MAX_FILE_CHARS})")
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
            self.check_expansion(node)  # before anything follows the aliases
            doc = yaml.safe_load(text)
        except RecursionError:
            self.fail_at((), "YAML nested too deeply for a cluster file")
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"{self.path}:{mark.line + 1}:{mark.column + 1}" if mark else self.path
            problem = getattr(err, "problem", None) or str(err)
            context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
            if context and start:
                problem += f" ({context}, line {start.line + 1})"
            self.fail(f"{where}: YAML syntax error: {problem}")
        if node is None or doc is None:
            self.fail_at((), f"the file is empty; {example}")
        self.record_lines(node, ())
        if not isinstance(doc, dict):
            self.fail_at((), f"the file must be a mapping, got {_yaml_type(doc)}; {example}")
        if ROOT not in doc:
            first = str(next(iter(doc)))
            typo = f" ({first!r} misspelled?)" if difflib.get_close_matches(first, [ROOT]) else ""
            found = ", ".join(repr(str(k)) for k in doc)
            self.fail_at((), f"no root key `{ROOT}:`{typo}; found {found} (see {EXAMPLE})")
        extra = [k for k in doc if k != ROOT]
        if extra:
            self.fail(
                *(self.error((k,), f"unknown key; the only root key is `{ROOT}`") for k in extra)
            )
        if not isinstance(doc[ROOT], dict):
            self.fail_at((ROOT,), f"expected a mapping of settings, got {_yaml_type(doc[ROOT])}")
        return doc[ROOT]

    def check_expansion(self, root: yaml.Node | None) -> None:
        """Fail on an anchor that contains an alias of itself (YAML would build a recursive
        value) and on aliases that expand to more than `MAX_YAML_VALUES` values. Walks the node
        graph once per node (an alias is the anchor's node), without expanding it."""
        if root is None:
            return
        size: dict[int, int] = {}  # id(node) -> values it expands to, itself included
        open_: set[int] = set()  # the nodes being walked: the path from the root
        stack: list[tuple[yaml.Node, bool]] = [(root, False)]
        while stack:
            node, walked = stack.pop()
            children = []
            if isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            elif isinstance(node, yaml.SequenceNode):
                children = list(node.value)
            if walked:
                open_.discard(id(node))
                size[id(node)] = 1 + sum(size[id(c)] for c in children)
                if size[id(node)] > MAX_YAML_VALUES:
                    self.fail_at(
                        (),
                        f"YAML anchors and aliases expand to more than {MAX_YAML_VALUES} values; "
                        "a cluster file needs a few dozen: write the settings out",
                        node.start_mark.line + 1,
                    )
                continue
            if id(node) in size:
                continue
            if id(node) in open_:
                line = node.start_mark.line + 1
                self.fail_at(
                    (),
                    f"the YAML anchor on line {line} contains an alias of itself (a recursive "
                    "value); a cluster file cannot be recursive",
                    line,
                )
            open_.add(id(node))
            stack.append((node, True))
            stack += [(c, False) for c in reversed(children)]

    def record_lines(self, node, prefix: tuple) -> None:
        """Record each key's line; a duplicate key fails (YAML would keep its last value)."""
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            loc, line = (*prefix, key_node.value), key_node.start_mark.line + 1
            if loc in self.lines:
                first = self.lines[loc]
                self.fail_at(loc, f"duplicate key (first on line {first}); give it once", line)
            self.lines[loc] = line
            self.record_lines(value_node, loc)

    # ---- stage 3: keys and types
    def check_types(self, cluster: dict) -> BaseModel:
        try:
            validated = _cluster_model().model_validate(cluster)
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
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            return self.error(loc, f"unknown key; {hint}allowed: {', '.join(allowed)}")
        if e["type"] == "invalid_key":  # loc ends with the key; the line is the key's
            what = f"a key must be a string, got {value!r} ({_yaml_type(value)})"
            return self.error(loc[:-1], what, self.line_of(loc))
        if len(loc) == 2 and loc[1] in SECTIONS:
            return self.error(loc, f"expected a mapping of settings, got {_yaml_type(value)}")
        key = next((k for k in self.keys if k.loc == loc), None)
        expected = _type_text(key.annotation) if key else e["msg"]
        return self.error(loc, f"expected {expected}, got {value!r} ({_yaml_type(value)})")

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

    def source(self, loc: tuple, value: object) -> tuple[str, int | None, object]:
        """(key path, line, value) of a key of the file, for `ClusterConfig.sources`."""
        return ".".join(str(p) for p in loc), self.line_of(loc), value

    def line_of(self, loc: tuple) -> int | None:
        """The line of the key at ``loc`` (non-string keys match by their text)."""
        return self.lines.get(tuple(str(p) for p in loc))

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
                key=lambda n: _mentions(text, n) or 0,
            )
            if _mentions(text, n)
        ]
        text += f" ({'; '.join(others)})" if others else ""
        if key is None:
            return self.error((ROOT,), text)
        return self.error(key.loc, text.removeprefix(key.name + " "))


def _cluster_model() -> type[BaseModel]:
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


def _mentions(text: str, name: str) -> int | None:
    """Where a message names the field ``name`` (``max_num_seqs`` or ``--max-num-seqs``),
    1-based; None when it does not."""
    flag = "--" + name.replace("_", "-")
    found = re.search(rf"(?<![\w-])(?:{name}|{flag})(?![\w-])", text)
    return found.start() + 1 if found else None


def _type_text(annotation: object) -> str:
    """``int | None`` -> "an integer or null"."""
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return " or ".join(names.get(a, "null" if a is type(None) else str(a)) for a in args)


def _yaml_type(value: object) -> str:
    """What YAML made of a value, in YAML's words."""
    for kind, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "a list"),
        (dict, "a mapping"),
    ):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


# ---------------------------------------------------------------------------------------------
# The schema as a table (docs/cluster-config.md, `batchgen config schema`)


def schema_markdown() -> str:
    """The Markdown table of every key: YAML key, CLI flag, default, meaning."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def default(key: SchemaKey) -> str:
        if key.name == "model":
            return "required"
        if key.default is None:
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
