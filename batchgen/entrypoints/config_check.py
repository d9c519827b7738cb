"""``batchgen config check FILE`` and ``batchgen config schema``: a cluster file's resolved
layout, or its errors, without loading any weights; and the table of every key.

``check`` prints the world size, replicas, every expert-parallel group's ranks and, when the
model's ``config.json`` is on this machine (a directory, or a hub id in the local Hugging Face
cache), which experts each rank holds; a hub id that is not local is reported and the layout
printed without expert placement. Exit code 0, or 2 with the errors (`CliError`).
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from batchgen.entrypoints.cli_flags import CliError
from batchgen.models.default_model import DEFAULT_MODEL_ID

if TYPE_CHECKING:
    from batchgen.cluster_config import ClusterConfig
    from batchgen.models.model_config import ModelConfig
    from batchgen.parallel_config import ParallelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = sub.add_parser(
        "check",
        help="validate a cluster file and print its layout (loads no weights)",
        description="Validate a cluster file (batchgen_cluster:) and print the resolved layout: "
        "world size, replicas, expert-parallel groups, experts per rank when the model's "
        "config.json is local. Exit code 0, or 2 with the errors.",
    )
    check.add_argument("file", metavar="FILE", help="the cluster YAML")
    sub.add_parser(
        "schema",
        help="print every key of the cluster file (Markdown table)",
        description="Print every key of the cluster file: YAML key, CLI flag, default, meaning.",
    )


def run(args: argparse.Namespace) -> int:
    from batchgen.cluster_config import ClusterConfigError, load_cluster_config, schema_markdown

    if args.config_command == "schema":
        print(schema_markdown(), end="")
        return 0
    try:
        cluster = load_cluster_config(args.file)
        lines = report(cluster)
    except ClusterConfigError as err:
        raise CliError(str(err)) from None
    except ValueError as err:
        raise CliError(f"{args.file}: {err}") from None
    print("\n".join(lines))
    return 0


def report(cluster: ClusterConfig) -> list[str]:
    """The lines `batchgen config check` prints for a valid `ClusterConfig`.

    Raises:
        ValueError: a problem only this machine can see: a model path that does not exist, an
            unreadable or unsupported local model, fewer experts than expert-parallel ranks,
            more local ranks than CUDA devices, a kv_cache_dtype an MLA model refuses.
    """
    from batchgen.distributed.layout import (
        ExpertPlacement,
        check_device_available,
        check_local_devices,
    )

    layout, parallel = cluster.layout, cluster.parallel
    world, ep, replicas = layout.world_size, layout.expert_parallel_size, layout.num_expert_replicas
    model = cluster.engine.model  # None: the file names the default model
    model_config, found = _local_model_config(model)
    lines = [
        f"{cluster.path}: valid",
        f"model: {model or DEFAULT_MODEL_ID} ({found})",
        f"world size: {world} ranks = {replicas} replica{'s' * (replicas != 1)} "
        f"(data_parallel_size) x {ep} rank{'s' * (ep != 1)} per expert-parallel group "
        "(expert_parallel_size)",
        f"prefill: {parallel.prefill_strategy}; decode: {parallel.resolved_decode_strategy}",
        f"expert-parallel groups (rank r is expert-parallel rank r % {ep} of replica r // {ep}):",
    ]
    lines += _listed(
        replicas,
        lambda g: f"  replica {g}: ranks {_span(list(range(g * ep, (g + 1) * ep)))}",
        lambda a, b: f"  ... replicas {a}-{b}: ranks {a * ep}-{(b + 1) * ep - 1}, {ep} per replica",
    )
    if model_config is None:
        lines.append("experts per rank: not shown, the model's config.json is not on this machine")
    elif not model_config.is_moe:
        lines.append("experts per rank: none, a dense model (the ranks run data-parallel only)")
    elif ep == 1:
        lines.append(f"experts per rank: all {model_config.num_local_experts} (replicated)")
    else:
        try:
            placement = ExpertPlacement(model_config.num_local_experts, ep)
        except ValueError as err:
            raise ValueError(f"batchgen_cluster.parallelism.expert_parallel_size: {err}") from None
        lines.append(f"experts per rank ({model_config.num_local_experts} routed experts):")

        def holds(r: int) -> str:
            experts = placement.experts_of(r)
            return (
                f"  expert-parallel rank {r} ({_every(r, ep, world)}): experts "
                f"{_span(experts)} ({len(experts)})"
            )

        lines += _listed(ep, holds, lambda a, b: f"  ... expert-parallel ranks {a}-{b}")
    lines += _kv_cache_dtype_warnings(cluster, model_config)
    check_local_devices(parallel, cluster.engine.device)
    try:
        check_device_available(cluster.engine.device)
    except ValueError:  # the job may run on another machine: a warning here
        lines.append(
            "warning: batchgen_cluster.engine.device is 'cuda' but this machine has no usable "
            "CUDA device: the job cannot start here (fine if it runs on another machine)"
        )
    lines.append("ranks started on this machine: " + _started_here(parallel, cluster.engine.device))
    lines += [f"warning: {w}" for w in parallel.ineffective_settings()]
    lines.append("the same as flags: " + shlex.join(cluster.flags()))
    return lines


def _kv_cache_dtype_warnings(cluster: ClusterConfig, model_config: ModelConfig | None) -> list:
    """Warning lines for ``engine.kv_cache_dtype`` on the local model: an MLA model
    (DeepSeek-V2/V3) takes only its own dtype (`resolve_kv_cache_dtype`), which under
    ``dtype: auto`` is the machine's choice (a warning then); under an explicit ``dtype`` any
    model is checked as the engine will (``bfloat16`` under ``float16`` is refused).

    Raises:
        ValueError: a format the engine would refuse at start, whatever the machine."""
    import torch

    from batchgen.models.layers.kv_cache_dtype import resolve_kv_cache_dtype

    engine = cluster.engine
    kv, dtype = engine.kv_cache_dtype, engine.dtype
    if kv == "auto" or model_config is None or (model_config.mla is None and dtype == "auto"):
        return []
    mla = model_config.mla is not None
    key = "batchgen_cluster.engine.kv_cache_dtype"
    if dtype == "auto" and kv == "bfloat16":  # valid where auto resolves to it
        return [
            f"warning: {key}: {kv!r} on an MLA model runs only where dtype 'auto' resolves to "
            f"{kv} (else the engine refuses it at start); set dtype: {kv} or kv_cache_dtype: auto"
        ]
    model_dtype = getattr(torch, dtype) if dtype != "auto" else None  # config.DTYPES names
    try:
        resolve_kv_cache_dtype(kv, model_dtype, mla=mla)  # type: ignore[arg-type]
    except ValueError as err:
        raise ValueError(f"{key}: {err}") from None
    return []


def _started_here(parallel: ParallelConfig, device: str) -> str:
    """Which ranks a job started here would start on this machine, and, where that is all of
    a many-rank job on CPU, that they would share this machine's CPUs (the file may well be
    meant for a cluster: ``data_parallel_size_local`` is the key that says so)."""
    import torch

    from batchgen.engine.cpu_threads import available_cpus

    world, local = parallel.data_parallel_size, parallel.data_parallel_size_local
    if parallel.distributed_executor_backend == "ray":
        return f"none as processes: Ray places all {world} ranks as actors on its cluster"
    if local is not None and local < world:
        return (
            f"{local} of {world} (data_parallel_size_local); the other {world - local} connect "
            "from other machines (python -m batchgen.distributed.launch, or torchrun)"
        )
    which = f"all {world}" + (" (data_parallel_size_local)" if local is not None else "")
    cpus = available_cpus()
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if world <= cpus or on_cuda:
        return which  # on CUDA, `check_local_devices` has compared them with the devices
    return (
        f"{which}, as processes sharing this machine's {cpus} CPUs ({world} > {cpus}); for a "
        "job across machines set parallelism.data_parallel_size_local to this machine's ranks "
        "(docs/distributed.md)"
    )


def _local_model_config(model: str | None) -> tuple[ModelConfig | None, str]:
    """(`ModelConfig` or None, how the model was found), reading only a local config.json
    (None, the default model: its checkpoint, built on first use as a run would).

    Raises:
        ValueError: a local path that does not exist or is not a checkpoint directory, or a
            config.json that is unreadable or of an unsupported architecture.
    """
    from huggingface_hub import try_to_load_from_cache

    from batchgen.models.default_model import default_model_path
    from batchgen.models.loader import resolve_model_path

    try:
        if model is None:
            config_dir, found = Path(default_model_path()), "the embedded default model"
        elif Path(model).expanduser().exists():
            config_dir, found = resolve_model_path(model), "local directory"
        else:
            try:
                cached = try_to_load_from_cache(model, "config.json")
            except Exception:  # not a hub id either: say why the way a run would
                resolve_model_path(model)
                raise
            if not isinstance(cached, str):
                return None, "a hub id, not in this machine's Hugging Face cache: layout only"
            config_dir, found = Path(cached).parent, "hub id, config.json in the local HF cache"
        from transformers import AutoConfig

        from batchgen.models.model_config import ModelConfig

        return ModelConfig.from_hf(AutoConfig.from_pretrained(config_dir)), found
    except (OSError, ValueError) as err:
        raise ValueError(f"batchgen_cluster.model: {err}") from None


# `batchgen config check` lists at most this many replicas (expert-parallel ranks) one per line;
# beyond, the first and last few and one line for those between.
MAX_LISTED = 16


def _listed(count: int, line: Callable[[int], str], between: Callable[[int, int], str]) -> list:
    """``line(i)`` for i < ``count``, or, past `MAX_LISTED`, the first 3, ``between(3, count -
    3)`` and the last 2."""
    if count <= MAX_LISTED:
        return [line(i) for i in range(count)]
    return [*map(line, range(3)), between(3, count - 3), *map(line, range(count - 2, count))]


def _span(ids: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> "0-3" (ids are contiguous)."""
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def _every(r: int, step: int, world: int) -> str:
    """ "ranks r, r + step, ..." below ``world``, shortened past four ("rank r" alone)."""
    ranks = list(range(r, world, step))
    if len(ranks) == 1:
        return f"rank {r}"
    listed = ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{r}, {r + step}, ..., {ranks[-1]}"
    return f"ranks {listed}"
