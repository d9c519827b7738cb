"""A validated cluster file (`ClusterConfig`), and flags or ``LLM`` arguments over it.

`ClusterConfig.merge` puts what was given over the file's settings key by key (the two names
of the running-sequence limit count as one key) and says which keys of the file each replaces;
`ClusterConfig.explain` says where each setting of an invalid combination comes from (the
file's key and line, or the flag given); `ClusterConfig.flags` is the file as a command line.
Loading and validating the file: `batchgen.cluster_config`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from batchgen.cluster_yaml import ClusterConfigError
from batchgen.config import ALIASES, EngineConfig
from batchgen.config_fields import given_text
from batchgen.distributed.layout import ParallelLayout
from batchgen.parallel_config import ParallelConfig


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
        named = [n for n in merged if n != "model" and mentions(text, n)]
        named = [n for n in named if n in given or n in self.sources]
        named.sort(key=lambda n: mentions(text, n))
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


def mentions(text: str, name: str) -> int | None:
    """Where a message names the field ``name`` (``max_num_seqs`` or ``--max-num-seqs``),
    1-based; None when it does not."""
    flag = "--" + name.replace("_", "-")
    found = re.search(rf"(?<![\w-])(?:{name}|{flag})(?![\w-])", text)
    return found.start() + 1 if found else None
