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

The checks run by `ParallelConfig.validate` and `ParallelConfig.ineffective_settings`, the
allowed values of the choice fields and `check_tensor_parallel_size` are in
`batchgen.parallel_config_checks` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from batchgen.config_fields import meta
from batchgen.parallel_config_checks import (  # noqa: F401 (re-exported)
    DECODE_STRATEGIES,
    EXECUTOR_BACKENDS,
    LOAD_BALANCE_METHODS,
    MAX_RANKS,
    PREFILL_STRATEGIES,
    check_tensor_parallel_size,
    ineffective_parallel_settings,
    validate_parallel_config,
)

# The snapshot intervals' defaults (batchgen/entrypoints/snapshot_writer.py uses them).
SEGMENT_MAX_RESULTS = 256
SEGMENT_MAX_AGE_S = 10.0


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
            "rank, streaming the experts it does not hold from the checkpoint, layer by layer",
            choices=PREFILL_STRATEGIES,
        ),
    )
    decode_strategy: str | None = field(
        default=None,
        metadata=meta(
            f"one of {DECODE_STRATEGIES}: data-parallel attention with expert-parallel MoE, "
            "or pure data parallelism with replicated experts (default: dp_attention_ep_moe "
            "with expert parallelism, else data_parallel)",
            choices=DECODE_STRATEGIES,
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
            "Ray cluster at $RAY_ADDRESS or, without it, on a local Ray instance",
            choices=EXECUTOR_BACKENDS,
        ),
    )
    load_balance_method: str = field(
        default="minimum_tokens",
        metadata=meta(
            f"one of {LOAD_BALANCE_METHODS} (SGLang's option): how the frontend assigns a "
            "request to a rank: the rank with the fewest estimated tokens in flight (prompt + "
            "max_tokens, times n), or each rank in turn",
            choices=LOAD_BALANCE_METHODS,
        ),
    )
    straggler_rebalance_interval_steps: int | None = field(
        default=None,
        metadata=meta(
            "every this many steps, ranks report their load and the frontend moves requests "
            "from the most to the least loaded rank (waiting ones as they are, started ones "
            "with their K/V shipped or by recompute; docs/distributed.md); unset: no "
            "rebalancing",
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
        """Check every field and their combinations (`validate_parallel_config`); runs on
        construction.

        Raises:
            ValueError: naming the field and its allowed values.
        """
        validate_parallel_config(self)

    def ineffective_settings(self) -> list[str]:
        """Settings given (not left at their defaults) that have no effect in this combination,
        or not yet in any, each as a sentence naming it; the engine warns about them at start."""
        return ineffective_parallel_settings(self)

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
