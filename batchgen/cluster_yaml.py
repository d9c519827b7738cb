"""Reading a cluster file's YAML safely, and reporting its problems where they are.

`ClusterFileReader` holds what every validation stage needs: the line of each key (recorded
from YAML's node graph) and the error format ``file:line: batchgen_cluster.section.key: what``
(`ClusterConfigError`). Its stages 1-2 (`ClusterFileReader.parse`) bound what the text may
make YAML build before anything expands it (`MAX_FILE_CHARS`; `MAX_YAML_VALUES` values,
aliases of anchors counted once per use; no recursive anchor), refuse duplicate keys, and
check the file's shape: a mapping with the one root key. The later stages (keys and types,
sizes, values) are `batchgen.cluster_config`'s.
"""

from __future__ import annotations

import difflib
import typing

import yaml

from batchgen.cluster_schema import EXAMPLE, ROOT

# Bounds on what a file may make YAML build (a cluster file has a few dozen values): its size,
# and the values it expands to, aliases of anchors counted once per use (a 1 KB file of nested
# aliases expands to billions: "billion laughs").
MAX_FILE_CHARS = 1 << 20
MAX_YAML_VALUES = 10_000


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


class ClusterFileReader:
    """One file's lines and errors, and its first validation stages (YAML and the file's
    shape); each failing stage raises."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lines: dict[tuple, int] = {}  # key path -> line of the key (1-based)

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

    def source(self, loc: tuple, value: object) -> tuple[str, int | None, object]:
        """(key path, line, value) of a key of the file, for `ClusterConfig.sources`."""
        return ".".join(str(p) for p in loc), self.line_of(loc), value

    def line_of(self, loc: tuple) -> int | None:
        """The line of the key at ``loc`` (non-string keys match by their text)."""
        return self.lines.get(tuple(str(p) for p in loc))

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
            self.fail_at((), f"the file must be a mapping, got {yaml_type(doc)}; {example}")
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
            self.fail_at((ROOT,), f"expected a mapping of settings, got {yaml_type(doc[ROOT])}")
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


def yaml_type(value: object) -> str:
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
