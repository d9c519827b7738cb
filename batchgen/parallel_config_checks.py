"""Validation of `ParallelConfig`: the allowed values of its choice fields, the checks that
`ParallelConfig.validate` runs (each `ValueError` names the field and its allowed values), the
settings that have no effect in a combination (`ParallelConfig.ineffective_settings`) and the
refusal of tensor parallelism (`check_tensor_parallel_size`).

`batchgen.parallel_config` re-exports every public name here.
"""

from __future__ import annotations

import re
from math import inf
from typing import TYPE_CHECKING

from batchgen.config_fields import is_int, is_number

if TYPE_CHECKING:
    from batchgen.parallel_config import ParallelConfig

# The most ranks a job may have (a sanity bound: the layout, the frontend's per-rank state and
# `batchgen config check` grow with it).
MAX_RANKS = 65536

PREFILL_STRATEGIES = ("expert_parallel", "data_parallel_offload")
DECODE_STRATEGIES = ("dp_attention_ep_moe", "data_parallel")
EXECUTOR_BACKENDS = ("mp", "ray")
LOAD_BALANCE_METHODS = ("minimum_tokens", "round_robin")


def validate_parallel_config(config: ParallelConfig) -> None:
    """Check every field of ``config`` and their combinations (`ParallelConfig.validate`).

    Raises:
        ValueError: a field out of its range or choices, or a contradicting combination; the
            message names the field(s) and the allowed values.
    """
    if not is_int(config.data_parallel_size) or not 1 <= config.data_parallel_size <= MAX_RANKS:
        raise ValueError(
            f"data_parallel_size must be an integer >= 1 and at most {MAX_RANKS} (ranks), "
            f"got {config.data_parallel_size!r}"
        )
    for name in (
        "expert_parallel_size",
        "prefill_stream_min_tokens",
        "straggler_rebalance_interval_steps",
        "snapshot_interval_results",
    ):
        value = getattr(config, name)
        if value is not None and (not is_int(value) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
    if config.data_parallel_size_local is not None and (
        not is_int(config.data_parallel_size_local)
        or not 0 <= config.data_parallel_size_local <= config.data_parallel_size
    ):
        raise ValueError(
            f"data_parallel_size_local must be an integer in [0, data_parallel_size="
            f"{config.data_parallel_size}], got {config.data_parallel_size_local!r}"
        )
    if not is_int(config.stream_buffer_layers) or config.stream_buffer_layers < 1:
        raise ValueError(
            f"stream_buffer_layers must be an integer >= 1, got {config.stream_buffer_layers!r}"
        )
    if not (is_number(config.distributed_timeout_s) and 0 < config.distributed_timeout_s < inf):
        raise ValueError(  # infinite: a stuck rank would never be detected
            f"distributed_timeout_s must be a number > 0 and finite (seconds), got "
            f"{config.distributed_timeout_s!r}"
        )
    if config.data_parallel_rpc_port is not None and (
        not is_int(config.data_parallel_rpc_port) or not 0 < config.data_parallel_rpc_port < 65536
    ):
        raise ValueError(
            f"data_parallel_rpc_port must be in [1, 65535], got {config.data_parallel_rpc_port!r}"
        )
    if not isinstance(config.enable_elastic_recovery, bool):
        raise ValueError(
            f"enable_elastic_recovery must be true or false, got {config.enable_elastic_recovery!r}"
        )
    uri = config.snapshot_storage_uri
    if uri is not None and not (isinstance(uri, str) and is_uri_or_path(uri)):
        raise ValueError(
            "snapshot_storage_uri must be a URI with a scheme and a location "
            f"(s3://bucket/prefix/, gs://bucket/prefix/, file:///dir/) or a path, got {uri!r}"
        )
    interval = config.snapshot_interval_s
    if interval is not None and not (is_number(interval) and 0 < interval < inf):
        raise ValueError(
            f"snapshot_interval_s must be a number > 0 and finite (seconds) or None, got "
            f"{interval!r}"
        )
    if config.load_balance_method not in LOAD_BALANCE_METHODS:
        raise ValueError(
            f"load_balance_method must be one of {LOAD_BALANCE_METHODS}, got "
            f"{config.load_balance_method!r}"
        )
    if config.distributed_executor_backend not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got "
            f"{config.distributed_executor_backend!r}"
        )
    local = config.data_parallel_size_local
    if config.distributed_executor_backend == "ray" and local not in (
        None,
        config.data_parallel_size,
    ):
        raise ValueError(
            f"data_parallel_size_local={local!r} cannot be combined with "
            "distributed_executor_backend='ray': Ray places every rank itself"
        )
    if config.prefill_strategy not in PREFILL_STRATEGIES:
        raise ValueError(
            f"prefill_strategy must be one of {PREFILL_STRATEGIES}, got {config.prefill_strategy!r}"
        )
    if config.decode_strategy is not None and config.decode_strategy not in DECODE_STRATEGIES:
        raise ValueError(
            f"decode_strategy must be one of {DECODE_STRATEGIES}, got {config.decode_strategy!r}"
        )
    ep = config.resolved_expert_parallel_size
    if config.data_parallel_size % ep:
        raise ValueError(
            f"expert_parallel_size={ep} must divide data_parallel_size={config.data_parallel_size}"
        )
    if config.decode_strategy == "data_parallel" and ep > 1:
        raise ValueError(
            "decode_strategy='data_parallel' replicates the experts, which contradicts "
            "--enable-expert-parallel / expert_parallel_size > 1; drop one of them"
        )
    wants_ep = config.enable_expert_parallel or config.decode_strategy == "dp_attention_ep_moe"
    if config.expert_parallel_size == 1 and config.data_parallel_size > 1 and wants_ep:
        raise ValueError(
            "expert_parallel_size=1 replicates the experts, which contradicts "
            "--enable-expert-parallel / decode_strategy='dp_attention_ep_moe'; drop one of "
            "them"
        )
    if config.prefill_strategy == "data_parallel_offload" and ep == 1:
        raise ValueError(
            "prefill_strategy='data_parallel_offload' streams the experts a rank does not "
            "hold, so it needs expert parallelism (--enable-expert-parallel or "
            "expert_parallel_size > 1)"
        )


def ineffective_parallel_settings(config: ParallelConfig) -> list[str]:
    """Settings of ``config`` given (not left at their defaults) that have no effect in this
    combination, or not yet in any, each as a sentence naming it
    (`ParallelConfig.ineffective_settings`)."""
    default = type(config)()
    one_rank = not config.is_distributed
    out = []
    if one_rank and config.enable_expert_parallel:
        out.append("enable_expert_parallel has no effect with one rank (data_parallel_size=1)")
    if one_rank and config.decode_strategy is not None:
        out.append(f"decode_strategy={config.decode_strategy!r} has no effect with one rank")
    if config.prefill_strategy != "data_parallel_offload":
        for name in ("prefill_stream_min_tokens", "stream_buffer_layers"):
            if getattr(config, name) != getattr(default, name):
                out.append(f"{name} has no effect without prefill_strategy='data_parallel_offload'")
    if one_rank:
        for name in (
            "distributed_timeout_s",
            "data_parallel_address",
            "data_parallel_rpc_port",
            "distributed_executor_backend",
            "load_balance_method",
            "straggler_rebalance_interval_steps",
        ):
            if getattr(config, name) != getattr(default, name):
                out.append(f"{name} has no effect with one rank (data_parallel_size=1)")
    if config.snapshot_storage_uri is None:
        for name in ("snapshot_interval_results", "snapshot_interval_s"):
            if getattr(config, name) is not None:
                out.append(f"{name} has no effect without snapshot_storage_uri")
    local = config.data_parallel_size_local
    if config.enable_elastic_recovery and local is not None and local < config.data_parallel_size:
        out.append(
            "enable_elastic_recovery restarts only the ranks this frontend starts: with "
            f"data_parallel_size_local={local} < data_parallel_size="
            f"{config.data_parallel_size}, the failed group of a rank started elsewhere is "
            "retired (the others run on), and a failure of every rank ends the job"
        )
    elif config.enable_elastic_recovery and config.data_parallel_size == 1:
        out.append("enable_elastic_recovery has no effect with one rank (data_parallel_size=1)")
    return out


def is_uri_or_path(text: str) -> bool:
    """``scheme://location`` with a scheme of letters, digits, ``+ - .`` (RFC 3986), or a
    non-empty path that does not start like a mistyped URI (``s3:/bucket``, ``s3:bucket``)."""
    scheme, sep, rest = text.partition("://")
    if sep:
        return bool(
            rest and scheme[:1].isalpha() and all(c.isalnum() or c in "+-." for c in scheme)
        )
    return bool(text.strip()) and re.match(r"^[A-Za-z][\w+.-]+:", text) is None


def check_tensor_parallel_size(value: object, *, flag: bool = False) -> None:
    """Accept vLLM's ``tensor_parallel_size`` at 1 (a no-op: vLLM users pass it) and refuse any
    other value: BatchGen does not shard a layer across ranks.

    Args:
        value: the size given (an int; a bool is not one).
        flag: word the error for ``--tensor-parallel-size`` (argparse prefixes the flag's
            name) instead of ``LLM(tensor_parallel_size=...)``.

    Raises:
        ValueError: ``value`` is not the integer 1; the message points to data-parallel ranks
            with expert parallelism, BatchGen's way to use several devices.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value == 1:
        return
    if flag:
        name, hint = "", "--data-parallel-size N --enable-expert-parallel"
    else:
        name, hint = "tensor_parallel_size ", "data_parallel_size=N, enable_expert_parallel=True"
    raise ValueError(
        f"{name}must be 1, got {value!r}: BatchGen has no tensor parallelism (1 is accepted as "
        f"a no-op); for several ranks use {hint} (data-parallel attention, the experts "
        "sharded over the ranks: docs/distributed.md)"
    )
