"""Engine configuration: one validated dataclass, every "auto" resolved in `resolve()`.

Field names follow vLLM's engine arguments (`max_model_len`, `max_num_seqs`,
`max_num_batched_tokens`, `block_size`, `gpu_memory_utilization`), so a vLLM user can carry
their settings over. The CLI builds one flag per field from `dataclasses.fields(EngineConfig)`
using each field's ``metadata["help"]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("coalesce", "lockstep")
# Sequences running at once when neither max_num_seqs nor max_active_coroutines is given:
# coalesce wants many coroutines to merge at each MoE layer; lockstep keeps vLLM's 256.
DEFAULT_MAX_NUM_SEQS = {"coalesce": 1024, "lockstep": 256}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class EngineConfig:
    """Engine settings. Validation raises `ValueError` naming the field and its allowed values."""

    model: str | None = field(
        default=None, metadata=_help("HF model directory or hub id (default: embedded model)")
    )
    tokenizer: str | None = field(default=None, metadata=_help("tokenizer path (default: model)"))
    served_model_name: str | None = field(
        default=None,
        metadata=_help(
            "the model's name in responses and /v1/models (default: the model directory's "
            "name, not its path, or the hub id)"
        ),
    )
    dtype: str = field(
        default="auto", metadata=_help(f"weights/activations dtype, one of {DTYPES}")
    )
    device: str = field(default="auto", metadata=_help(f"one of {DEVICES}"))
    seed: int = field(
        default=0,
        metadata=_help(
            "seed of the global RNG that unseeded requests draw from; their samples "
            "still depend on batching, so give a request its own `seed` to make it "
            "reproducible"
        ),
    )
    max_model_len: int | None = field(
        default=None, metadata=_help("max prompt+output tokens per sequence (default: model's)")
    )
    max_num_seqs: int | None = field(
        default=None,
        metadata=_help(
            "max sequences running at once (KV permitting), under every policy; "
            "max_active_coroutines is another name for it "
            f"(default: {DEFAULT_MAX_NUM_SEQS['coalesce']} with coalesce, "
            f"{DEFAULT_MAX_NUM_SEQS['lockstep']} with lockstep)"
        ),
    )
    max_num_batched_tokens: int = field(
        default=2048, metadata=_help("max tokens per engine step (chunked prefill budget)")
    )
    block_size: int = field(default=16, metadata=_help("KV cache block size in tokens"))
    kv_cache_memory_gb: float | None = field(
        default=None,
        metadata=_help(
            "KV cache budget in GiB (default: 1 on CPU, gpu_memory_utilization on CUDA)"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_help("fraction of CUDA memory for weights+activations+KV cache")
    )
    scheduler_policy: str = field(
        default="coalesce",
        metadata=_help(
            f"step executor policy, one of {POLICIES}: coalesce merges MoE layers "
            "across attention micro-batches; lockstep is classic continuous batching"
        ),
    )
    max_active_coroutines: int | None = field(
        default=None,
        metadata=_help(
            "the same limit as max_num_seqs, by its name in the cluster YAML "
            "(coroutine_scheduler.max_active_coroutines); give one, or both equal"
        ),
    )
    max_step_tokens: int | None = field(
        default=None,
        metadata=_help(
            "coalesce: max tokens per step over all micro-batches "
            "(default 8 x max_num_batched_tokens)"
        ),
    )
    expert_coalesce_threshold: int = field(
        default=32,
        metadata=_help(
            "coalesce: hold an MoE stage while experts would get fewer rows than "
            "this on average and other micro-batches can still reach it"
        ),
    )
    enable_prefix_sharing: bool = field(
        default=True,
        metadata=_help(
            "the n samples of a request share their prompt's KV blocks: the prompt is "
            "prefilled once, not n times"
        ),
    )
    tile_size: int = field(default=64, metadata=_help("GEMM tile rows for the tile-density metric"))
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=_help("force the number of KV blocks (testing preemption)")
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.served_model_name is not None and (
            not isinstance(self.served_model_name, str) or not self.served_model_name.strip()
        ):
            raise ValueError(
                f"served_model_name must be a non-empty string or None, got "
                f"{self.served_model_name!r}"
            )
        if self.scheduler_policy not in POLICIES:
            raise ValueError(
                f"scheduler_policy must be one of {POLICIES}, got {self.scheduler_policy!r}"
            )
        for name in (
            "max_num_batched_tokens",
            "block_size",
            "seed",
            "expert_coalesce_threshold",
            "tile_size",
        ):
            value = getattr(self, name)
            if not _is_int(value) or (name != "seed" and value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in (
            "max_model_len",
            "num_gpu_blocks_override",
            "max_step_tokens",
            "max_num_seqs",
            "max_active_coroutines",
        ):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if (
            self.max_num_seqs is not None
            and self.max_active_coroutines is not None
            and self.max_num_seqs != self.max_active_coroutines
        ):
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs} and max_active_coroutines="
                f"{self.max_active_coroutines} name the same limit (sequences running at "
                "once): give one of them, or both equal"
            )
        if self.kv_cache_memory_gb is not None and not (
            _is_number(self.kv_cache_memory_gb) and 0 < self.kv_cache_memory_gb < math.inf
        ):
            raise ValueError(
                f"kv_cache_memory_gb must be a finite number > 0 (GiB) or None, "
                f"got {self.kv_cache_memory_gb!r}"
            )
        if not (_is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )

    @property
    def step_token_budget(self) -> int:
        """Tokens per engine step: ``max_num_batched_tokens`` for lockstep; for coalesce
        ``max_step_tokens`` (default 8 micro-batches' worth)."""
        if self.scheduler_policy == "lockstep":
            return self.max_num_batched_tokens
        return self.max_step_tokens or 8 * self.max_num_batched_tokens

    @property
    def max_running_seqs(self) -> int:
        """Most sequences running at once, under every policy: ``max_num_seqs`` (vLLM's name)
        or ``max_active_coroutines`` (the cluster YAML's name for the same limit), else
        `DEFAULT_MAX_NUM_SEQS` of the policy."""
        return (
            self.max_num_seqs
            or self.max_active_coroutines
            or DEFAULT_MAX_NUM_SEQS[self.scheduler_policy]
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


PREFILL_STRATEGIES = ("expert_parallel", "data_parallel_offload")
DECODE_STRATEGIES = ("dp_attention_ep_moe", "data_parallel")


@dataclass
class ParallelConfig:
    """How a job spreads over processes and machines (DESIGN.md, phase-specific parallelism).

    Flag names follow vLLM's (``--data-parallel-size``, ``--enable-expert-parallel``,
    ``--data-parallel-size-local``, ``--data-parallel-address``, ``--data-parallel-rpc-port``);
    the rest are BatchGen's. `batchgen.distributed.layout.resolve_layout` turns the sizes into
    the rank grid. Validation raises `ValueError` naming the field and its allowed values.
    """

    data_parallel_size: int = field(
        default=1,
        metadata={
            **_help(
                "ranks (processes), each running attention on its own requests with its own KV "
                "cache (vLLM's flag; engine settings such as the KV cache budget and "
                "--max-num-seqs apply to each rank); with --enable-expert-parallel all of them "
                "form one expert-parallel group, as in vLLM"
            ),
            "short": "-dp",
        },
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=_help(
            "shard the routed experts over the ranks (tokens dispatched to their experts' "
            "ranks and combined back with all-to-all) instead of replicating them"
        ),
    )
    expert_parallel_size: int | None = field(
        default=None,
        metadata=_help(
            "ranks per expert-parallel group (implies expert parallelism; must divide "
            "data_parallel_size; data_parallel_size / expert_parallel_size groups hold one "
            "copy of the experts each). Default: all ranks with --enable-expert-parallel, else 1"
        ),
    )
    prefill_strategy: str = field(
        default="expert_parallel",
        metadata=_help(
            f"one of {PREFILL_STRATEGIES}: expert_parallel dispatches prefill tokens like "
            "decode tokens; data_parallel_offload runs a large prefill's experts on its own "
            "rank, streaming the experts it does not hold from the checkpoint, layer by layer"
        ),
    )
    decode_strategy: str | None = field(
        default=None,
        metadata=_help(
            f"one of {DECODE_STRATEGIES}: data-parallel attention with expert-parallel MoE, "
            "or pure data parallelism with replicated experts (default: dp_attention_ep_moe "
            "with expert parallelism, else data_parallel)"
        ),
    )
    prefill_stream_min_tokens: int | None = field(
        default=None,
        metadata=_help(
            "data_parallel_offload: a rank streams experts in a step with at least this many "
            "prefill tokens (default: where dispatching them would move as many bytes as "
            "streaming the experts it lacks)"
        ),
    )
    stream_buffer_layers: int = field(
        default=2,
        metadata=_help("data_parallel_offload: layers of streamed experts held at once (>= 1)"),
    )
    distributed_timeout_s: float = field(
        default=300.0,
        metadata=_help(
            "seconds a rank may stay silent (stuck) before the job fails naming it; a rank "
            "that dies is reported at once"
        ),
    )
    data_parallel_size_local: int | None = field(
        default=None,
        metadata=_help(
            "ranks to start on this machine (default: all); the others connect from other "
            "machines (`python -m batchgen.distributed.launch`, or torchrun)"
        ),
    )
    data_parallel_address: str = field(
        default="127.0.0.1",
        metadata=_help("address the frontend listens on for ranks (and their rendezvous)"),
    )
    data_parallel_rpc_port: int | None = field(
        default=None,
        metadata=_help(
            "port the frontend listens on for ranks (default: a free port; needed when ranks "
            "start on other machines)"
        ),
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not _is_int(self.data_parallel_size) or self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}"
            )
        for name in ("expert_parallel_size", "prefill_stream_min_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if self.data_parallel_size_local is not None and (
            not _is_int(self.data_parallel_size_local)
            or not 0 <= self.data_parallel_size_local <= self.data_parallel_size
        ):
            raise ValueError(
                f"data_parallel_size_local must be an integer in [0, data_parallel_size="
                f"{self.data_parallel_size}], got {self.data_parallel_size_local!r}"
            )
        if not _is_int(self.stream_buffer_layers) or self.stream_buffer_layers < 1:
            raise ValueError(
                f"stream_buffer_layers must be an integer >= 1, got {self.stream_buffer_layers!r}"
            )
        if not (_is_number(self.distributed_timeout_s) and 0 < self.distributed_timeout_s):
            raise ValueError(
                f"distributed_timeout_s must be a number > 0 (seconds), got "
                f"{self.distributed_timeout_s!r}"
            )
        if self.data_parallel_rpc_port is not None and (
            not _is_int(self.data_parallel_rpc_port) or not 0 < self.data_parallel_rpc_port < 65536
        ):
            raise ValueError(
                f"data_parallel_rpc_port must be in [1, 65535], got {self.data_parallel_rpc_port!r}"
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
        if self.prefill_strategy == "data_parallel_offload" and ep == 1:
            raise ValueError(
                "prefill_strategy='data_parallel_offload' streams the experts a rank does not "
                "hold, so it needs expert parallelism (--enable-expert-parallel or "
                "expert_parallel_size > 1)"
            )

    def ineffective_settings(self) -> list[str]:
        """Settings given (not left at their defaults) that have no effect in this combination,
        each as a sentence naming it; the engine warns about them at start."""
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
            ):
                if getattr(self, name) != getattr(default, name):
                    out.append(f"{name} has no effect with one rank (data_parallel_size=1)")
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
    def is_distributed(self) -> bool:
        """True when the job runs in rank processes (more than one rank, or ranks elsewhere)."""
        return self.data_parallel_size > 1 or self.data_parallel_size_local == 0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
