"""`ParallelConfig`: how a job spreads over processes and machines, validated once.

Flag names follow vLLM's (``--data-parallel-size``, ``--enable-expert-parallel``,
``--data-parallel-size-local``, ``--data-parallel-address``, ``--data-parallel-rpc-port``,
``--distributed-executor-backend``); the
rest are BatchGen's. ``data_parallel_size`` counts *ranks* here, as in vLLM; the cluster YAML's
``parallelism.data_parallel_size`` counts expert-parallel *replicas* instead, and
`batchgen.cluster_config` maps one onto the other. `batchgen.distributed.layout.resolve_layout`
turns the sizes into the rank grid.

The settings of the cluster-operations issue are acted on: the snapshot settings
(``snapshot_storage_uri`` and its intervals) by ``batchgen run``
(`batchgen.entrypoints.snapshot_store`), elastic recovery and straggler rebalancing by the
data-parallel frontend (`batchgen.distributed.recovery`, `batchgen.distributed.rebalance`).
`ineffective_settings` names settings given where they have no effect; the engine logs them
as warnings at start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from math import inf

from batchgen.config_fields import is_int, is_number, meta

# The snapshot intervals' defaults (batchgen/entrypoints/snapshot_writer.py uses them).
SEGMENT_MAX_RESULTS = 256
SEGMENT_MAX_AGE_S = 10.0

# The most ranks a job may have (a sanity bound: the layout, the frontend's per-rank state and
# `batchgen config check` grow with it).
MAX_RANKS = 65536

PREFILL_STRATEGIES = ("expert_parallel", "data_parallel_offload")
DECODE_STRATEGIES = ("dp_attention_ep_moe", "data_parallel")
EXECUTOR_BACKENDS = ("mp", "ray")
LOAD_BALANCE_METHODS = ("minimum_tokens", "round_robin")


@dataclass
class ParallelConfig:
    """How a job spreads over processes and machines (DESIGN.md, phase-specific parallelism).

    Validation raises `ValueError` naming the field and its allowed values.
    """

    data_parallel_size: int = field(
        default=1,
        metadata=meta(
            "ranks (processes), each running attention on its own requests with its own KV "
            "cache (vLLM's flag; engine settings such as the KV cache budget and "
            "--max-num-seqs apply to each rank); with --enable-expert-parallel all of them "
            "form one expert-parallel group, as in vLLM",
            short="-dp",
        ),
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=meta(
            "shard the routed experts over the ranks (tokens dispatched to their experts' "
            "ranks and combined back with all-to-all) instead of replicating them"
        ),
    )
    expert_parallel_size: int | None = field(
        default=None,
        metadata=meta(
            "ranks per expert-parallel group (implies expert parallelism; must divide "
            "data_parallel_size; data_parallel_size / expert_parallel_size groups hold one "
            "copy of the experts each). Default: all ranks with --enable-expert-parallel, else 1"
        ),
    )
    prefill_strategy: str = field(
        default="expert_parallel",
        metadata=meta(
            f"one of {PREFILL_STRATEGIES}: expert_parallel dispatches prefill tokens like "
            "decode tokens; data_parallel_offload runs a large prefill's experts on its own "
            "rank, streaming the experts it does not hold from the checkpoint, layer by layer"
        ),
    )
    decode_strategy: str | None = field(
        default=None,
        metadata=meta(
            f"one of {DECODE_STRATEGIES}: data-parallel attention with expert-parallel MoE, "
            "or pure data parallelism with replicated experts (default: dp_attention_ep_moe "
            "with expert parallelism, else data_parallel)"
        ),
    )
    prefill_stream_min_tokens: int | None = field(
        default=None,
        metadata=meta(
            "data_parallel_offload: a rank streams experts in a step with at least this many "
            "prefill tokens (default: where dispatching them would move as many bytes as "
            "streaming the experts it lacks)"
        ),
    )
    stream_buffer_layers: int = field(
        default=2,
        metadata=meta("data_parallel_offload: layers of streamed experts held at once (>= 1)"),
    )
    distributed_timeout_s: float = field(
        default=300.0,
        metadata=meta(
            "seconds a rank may stay silent (stuck) before the job fails naming it; a rank "
            "that dies is reported at once"
        ),
    )
    data_parallel_size_local: int | None = field(
        default=None,
        metadata=meta(
            "ranks to start on this machine (default: all); the others connect from other "
            "machines (`python -m batchgen.distributed.launch`, or torchrun)"
        ),
    )
    data_parallel_address: str = field(
        default="127.0.0.1",
        metadata=meta("address the frontend listens on for ranks (and their rendezvous)"),
    )
    data_parallel_rpc_port: int | None = field(
        default=None,
        metadata=meta(
            "port the frontend listens on for ranks (default: a free port; needed when ranks "
            "start on other machines)"
        ),
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata=meta(
            f"one of {EXECUTOR_BACKENDS} (vLLM's flag): mp starts the ranks as processes on "
            "this machine; ray starts every rank as a Ray actor in a placement group, on the "
            "Ray cluster at $RAY_ADDRESS or, without it, on a local Ray instance"
        ),
    )
    load_balance_method: str = field(
        default="minimum_tokens",
        metadata=meta(
            f"one of {LOAD_BALANCE_METHODS} (SGLang's option): how the frontend assigns a "
            "request to a rank: the rank with the fewest estimated tokens in flight (prompt + "
            "max_tokens, times n), or each rank in turn"
        ),
    )
    straggler_rebalance_interval_steps: int | None = field(
        default=None,
        metadata=meta(
            "every this many steps, ranks report their load and the frontend moves requests "
            "from the most to the least loaded rank (waiting ones as they are, started ones "
            "with their K/V shipped or by recompute; docs/distributed.md)",
            section="coroutine_scheduler",
        ),
    )
    enable_elastic_recovery: bool = field(
        default=False,
        metadata=meta(
            "when a rank dies or goes silent, start its restart group again and re-queue its "
            "unfinished requests instead of failing the job (at most 3 restarts; a group that "
            "cannot start again, or fails after that, is retired while another group is "
            "left; docs/distributed.md)",
            section="checkpoint_service",
        ),
    )
    snapshot_storage_uri: str | None = field(
        default=None,
        metadata=meta(
            "batchgen run: store the job's manifest, finished results and progress here, any "
            "fsspec URL (s3://bucket/prefix/, gs://bucket/prefix/, file:///dir/) or a path; "
            "a run given a snapshot of the same job resumes from it, on any machine "
            "(docs/snapshots.md)",
            section="checkpoint_service",
        ),
    )
    snapshot_interval_results: int | None = field(
        default=None,
        metadata=meta(
            f"store a snapshot segment once this many results are waiting (default: "
            f"{SEGMENT_MAX_RESULTS})",
            section="checkpoint_service",
        ),
    )
    snapshot_interval_s: float | None = field(
        default=None,
        metadata=meta(
            f"store a snapshot segment once the oldest waiting result is this many seconds "
            f"old (default: {SEGMENT_MAX_AGE_S:g})",
            section="checkpoint_service",
        ),
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not is_int(self.data_parallel_size) or not 1 <= self.data_parallel_size <= MAX_RANKS:
            raise ValueError(
                f"data_parallel_size must be an integer >= 1 and at most {MAX_RANKS} (ranks), "
                f"got {self.data_parallel_size!r}"
            )
        for name in (
            "expert_parallel_size",
            "prefill_stream_min_tokens",
            "straggler_rebalance_interval_steps",
            "snapshot_interval_results",
        ):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if self.data_parallel_size_local is not None and (
            not is_int(self.data_parallel_size_local)
            or not 0 <= self.data_parallel_size_local <= self.data_parallel_size
        ):
            raise ValueError(
                f"data_parallel_size_local must be an integer in [0, data_parallel_size="
                f"{self.data_parallel_size}], got {self.data_parallel_size_local!r}"
            )
        if not is_int(self.stream_buffer_layers) or self.stream_buffer_layers < 1:
            raise ValueError(
                f"stream_buffer_layers must be an integer >= 1, got {self.stream_buffer_layers!r}"
            )
        if not (is_number(self.distributed_timeout_s) and 0 < self.distributed_timeout_s < inf):
            raise ValueError(  # infinite: a stuck rank would never be detected
                f"distributed_timeout_s must be a number > 0 and finite (seconds), got "
                f"{self.distributed_timeout_s!r}"
            )
        if self.data_parallel_rpc_port is not None and (
            not is_int(self.data_parallel_rpc_port) or not 0 < self.data_parallel_rpc_port < 65536
        ):
            raise ValueError(
                f"data_parallel_rpc_port must be in [1, 65535], got {self.data_parallel_rpc_port!r}"
            )
        if not isinstance(self.enable_elastic_recovery, bool):
            raise ValueError(
                f"enable_elastic_recovery must be true or false, got "
                f"{self.enable_elastic_recovery!r}"
            )
        uri = self.snapshot_storage_uri
        if uri is not None and not (isinstance(uri, str) and _is_uri_or_path(uri)):
            raise ValueError(
                "snapshot_storage_uri must be a URI with a scheme and a location "
                f"(s3://bucket/prefix/, gs://bucket/prefix/, file:///dir/) or a path, got {uri!r}"
            )
        interval = self.snapshot_interval_s
        if interval is not None and not (is_number(interval) and 0 < interval < inf):
            raise ValueError(
                f"snapshot_interval_s must be a number > 0 and finite (seconds) or None, got "
                f"{interval!r}"
            )
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"load_balance_method must be one of {LOAD_BALANCE_METHODS}, got "
                f"{self.load_balance_method!r}"
            )
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got "
                f"{self.distributed_executor_backend!r}"
            )
        local = self.data_parallel_size_local
        if self.distributed_executor_backend == "ray" and local not in (
            None,
            self.data_parallel_size,
        ):
            raise ValueError(
                f"data_parallel_size_local={local!r} cannot be combined with "
                "distributed_executor_backend='ray': Ray places every rank itself"
            )
        if self.prefill_strategy not in PREFILL_STRATEGIES:
            raise ValueError(
                f"prefill_strategy must be one of {PREFILL_STRATEGIES}, got "
                f"{self.prefill_strategy!r}"
            )
        if self.decode_strategy is not None and self.decode_strategy not in DECODE_STRATEGIES:
            raise ValueError(
                f"decode_strategy must be one of {DECODE_STRATEGIES}, got {self.decode_strategy!r}"
            )
        ep = self.resolved_expert_parallel_size
        if self.data_parallel_size % ep:
            raise ValueError(
                f"expert_parallel_size={ep} must divide data_parallel_size="
                f"{self.data_parallel_size}"
            )
        if self.decode_strategy == "data_parallel" and ep > 1:
            raise ValueError(
                "decode_strategy='data_parallel' replicates the experts, which contradicts "
                "--enable-expert-parallel / expert_parallel_size > 1; drop one of them"
            )
        wants_ep = self.enable_expert_parallel or self.decode_strategy == "dp_attention_ep_moe"
        if self.expert_parallel_size == 1 and self.data_parallel_size > 1 and wants_ep:
            raise ValueError(
                "expert_parallel_size=1 replicates the experts, which contradicts "
                "--enable-expert-parallel / decode_strategy='dp_attention_ep_moe'; drop one of "
                "them"
            )
        if self.prefill_strategy == "data_parallel_offload" and ep == 1:
            raise ValueError(
                "prefill_strategy='data_parallel_offload' streams the experts a rank does not "
                "hold, so it needs expert parallelism (--enable-expert-parallel or "
                "expert_parallel_size > 1)"
            )

    def ineffective_settings(self) -> list[str]:
        """Settings given (not left at their defaults) that have no effect in this combination,
        or not yet in any, each as a sentence naming it; the engine warns about them at start."""
        default = ParallelConfig()
        one_rank = not self.is_distributed
        out = []
        if one_rank and self.enable_expert_parallel:
            out.append("enable_expert_parallel has no effect with one rank (data_parallel_size=1)")
        if one_rank and self.decode_strategy is not None:
            out.append(f"decode_strategy={self.decode_strategy!r} has no effect with one rank")
        if self.prefill_strategy != "data_parallel_offload":
            for name in ("prefill_stream_min_tokens", "stream_buffer_layers"):
                if getattr(self, name) != getattr(default, name):
                    out.append(
                        f"{name} has no effect without prefill_strategy='data_parallel_offload'"
                    )
        if one_rank:
            for name in (
                "distributed_timeout_s",
                "data_parallel_address",
                "data_parallel_rpc_port",
                "distributed_executor_backend",
                "load_balance_method",
                "straggler_rebalance_interval_steps",
            ):
                if getattr(self, name) != getattr(default, name):
                    out.append(f"{name} has no effect with one rank (data_parallel_size=1)")
        if self.snapshot_storage_uri is None:
            for name in ("snapshot_interval_results", "snapshot_interval_s"):
                if getattr(self, name) is not None:
                    out.append(f"{name} has no effect without snapshot_storage_uri")
        local = self.data_parallel_size_local
        if self.enable_elastic_recovery and local is not None and local < self.data_parallel_size:
            out.append(
                "enable_elastic_recovery restarts only the ranks this frontend starts: with "
                f"data_parallel_size_local={local} < data_parallel_size="
                f"{self.data_parallel_size}, the failed group of a rank started elsewhere is "
                "retired (the others run on), and a failure of every rank ends the job"
            )
        elif self.enable_elastic_recovery and self.data_parallel_size == 1:
            out.append("enable_elastic_recovery has no effect with one rank (data_parallel_size=1)")
        return out

    @property
    def resolved_expert_parallel_size(self) -> int:
        """Ranks per expert-parallel group after defaults (see the field's help)."""
        if self.expert_parallel_size is not None:
            return self.expert_parallel_size
        if self.enable_expert_parallel or self.decode_strategy == "dp_attention_ep_moe":
            return self.data_parallel_size
        return 1

    @property
    def resolved_decode_strategy(self) -> str:
        """``decode_strategy`` after its default (see the field's help)."""
        if self.decode_strategy is not None:
            return self.decode_strategy
        ep = self.resolved_expert_parallel_size
        return "dp_attention_ep_moe" if ep > 1 else "data_parallel"

    @property
    def is_distributed(self) -> bool:
        """True when the job runs in rank processes (more than one rank, or ranks elsewhere)."""
        return self.data_parallel_size > 1 or self.data_parallel_size_local == 0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _is_uri_or_path(text: str) -> bool:
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
