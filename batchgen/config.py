"""Engine configuration: one validated dataclass, every "auto" resolved in `resolve()`.

Field names follow vLLM's engine arguments (`max_model_len`, `max_num_seqs`,
`max_num_batched_tokens`, `block_size`, `gpu_memory_utilization`), so a vLLM user can carry
their settings over. The CLI builds one flag per field from `dataclasses.fields(EngineConfig)`
using each field's ``metadata["help"]``; the cluster YAML puts each field in the section its
``metadata["section"]`` names (default ``engine``; see `batchgen.config_fields`).

`ParallelConfig` lives in `batchgen.parallel_config` and is re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from batchgen.config_fields import TOP_LEVEL, is_int, is_number, meta
from batchgen.parallel_config import (  # noqa: F401  (re-exported)
    DECODE_STRATEGIES,
    PREFILL_STRATEGIES,
    ParallelConfig,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("coalesce", "lockstep")
# Sequences running at once when neither max_num_seqs nor max_active_coroutines is given:
# coalesce wants many coroutines to merge at each MoE layer; lockstep keeps vLLM's 256.
DEFAULT_MAX_NUM_SEQS = {"coalesce": 1024, "lockstep": 256}
SCHED = "coroutine_scheduler"  # the cluster YAML section of the scheduling limits
# Fields that name the same setting: one given over a cluster file replaces the file's value
# under either name (flag > file, the pair treated as one key).
ALIASES = {"max_num_seqs": ("max_active_coroutines",), "max_active_coroutines": ("max_num_seqs",)}


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default CUDA graph capture sizes: 1, 2, 4, then every multiple of 8, up to
    ``min(max_num_seqs, 512)`` (vLLM ``CompilationConfig``; ``[1]`` at least).

    Example: ``max_num_seqs=20`` -> ``[1, 2, 4, 8, 16]``."""
    limit = min(max_num_seqs, 512)
    return [n for n in [1, 2, 4, *range(8, 513, 8)] if n <= limit] or [1]


@dataclass
class EngineConfig:
    """Engine settings. Validation raises `ValueError` naming the field and its allowed values."""

    model: str | None = field(
        default=None,
        metadata=meta(
            "HF model directory or hub id (default: the embedded random-weights model, "
            "also named batchgen/default-mixtral-v1; required in the cluster YAML)",
            section=TOP_LEVEL,
        ),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=meta(
            "tokenizer path or hub id (default: the model's); batchgen/default-mixtral-v1 is "
            "the default model's"
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=meta(
            "the model's name in responses and /v1/models (default: the model directory's "
            "name, not its path, or the hub id)"
        ),
    )
    dtype: str = field(
        default="auto", metadata=meta(f"weights/activations dtype, one of {DTYPES}", choices=DTYPES)
    )
    device: str = field(default="auto", metadata=meta(f"one of {DEVICES}", choices=DEVICES))
    seed: int = field(
        default=0,
        metadata=meta(
            "seed of the global RNG that unseeded requests draw from; their samples "
            "still depend on batching, so give a request its own `seed` to make it "
            "reproducible"
        ),
    )
    max_model_len: int | None = field(
        default=None, metadata=meta("max prompt+output tokens per sequence (default: model's)")
    )
    max_num_seqs: int | None = field(
        default=None,
        metadata=meta(
            "max sequences running at once (KV permitting), under every policy; "
            "max_active_coroutines is another name for it "
            f"(default: {DEFAULT_MAX_NUM_SEQS['coalesce']} with coalesce, "
            f"{DEFAULT_MAX_NUM_SEQS['lockstep']} with lockstep)",
            section=SCHED,
        ),
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata=meta("max tokens per engine step (chunked prefill budget)", section=SCHED),
    )
    block_size: int = field(default=16, metadata=meta("KV cache block size in tokens"))
    kv_cache_dtype: str = field(
        default="auto",
        metadata=meta(
            f"KV cache storage dtype, one of {KV_CACHE_DTYPES} (vLLM's): auto is the model's "
            "dtype; bfloat16 halves a float32 model's KV bytes, fp8 (= fp8_e4m3) and "
            "fp8_e5m2 store one byte per element (scale 1.0): the budget holds 2-4x the "
            "tokens and CPU decode reads less, at some accuracy; on CUDA the narrower cache "
            "runs the torch decode path without CUDA graphs, capacity rather than speed "
            "(docs/performance.md); not for MLA",
            choices=KV_CACHE_DTYPES,
        ),
    )
    kv_cache_memory_gb: float | None = field(
        default=None,
        metadata=meta("KV cache budget in GiB (default: 1 on CPU, gpu_memory_utilization on CUDA)"),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=meta("fraction of CUDA memory for weights+activations+KV cache")
    )
    scheduler_policy: str = field(
        default="coalesce",
        metadata=meta(
            f"step executor policy, one of {POLICIES}: coalesce merges MoE layers "
            "across attention micro-batches; lockstep is classic continuous batching",
            section=SCHED,
            choices=POLICIES,
        ),
    )
    max_active_coroutines: int | None = field(
        default=None,
        metadata=meta(
            "the same limit as max_num_seqs, by its name in the cluster YAML "
            "(coroutine_scheduler.max_active_coroutines); give one, or both equal; a flag or "
            "argument of either name overrides the file's value of either",
            section=SCHED,
        ),
    )
    max_step_tokens: int | None = field(
        default=None,
        metadata=meta(
            "coalesce: max tokens per step over all micro-batches "
            "(default 8 x max_num_batched_tokens)",
            section=SCHED,
        ),
    )
    expert_coalesce_threshold: int = field(
        default=32,
        metadata=meta(
            "coalesce: hold an MoE stage while experts would get fewer rows than "
            "this on average and other micro-batches can still reach it",
            section=SCHED,
        ),
    )
    enable_prefix_sharing: bool = field(
        default=True,
        metadata=meta(
            "the n samples of a request share their prompt's KV blocks: the prompt is "
            "prefilled once, not n times"
        ),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=meta(
            "automatic prefix caching across requests (vLLM's): full KV blocks are kept by "
            "content after their requests end, and a prompt that starts with cached blocks "
            "skips their prefill; requests with prompt_logprobs never take a hit"
        ),
    )
    batch_invariant: bool = field(
        default=False,
        metadata=meta(
            "a greedy or seeded request gets the same tokens whatever it is batched with: "
            "row-independent GEMMs and prompts cut at fixed positions (CPU float32 only; "
            "costs up to a few percent, docs/batch-invariance.md)"
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=meta(
            "never capture CUDA graphs: every step runs eagerly (vLLM's flag); graphs are "
            "only ever used on CUDA, for decode-only steps (docs/gpu.md)"
        ),
    )
    cudagraph_capture_sizes: list[int] | None = field(
        default=None,
        metadata=meta(
            "decode batch sizes to capture a CUDA graph for; a decode step is padded to the "
            "next one (default, vLLM's: 1, 2, 4 and multiples of 8 up to "
            "min(max_num_seqs, 512))"
        ),
    )
    tile_size: int = field(default=64, metadata=meta("GEMM tile rows for the tile-density metric"))
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=meta("force the number of KV blocks (testing preemption)")
    )

    def __post_init__(self) -> None:
        from batchgen.models.default_model import DEFAULT_MODEL_ID, names_default_model

        if isinstance(self.model, str) and names_default_model(self.model):
            self.model = None  # the default model's name: the same as no model given
        if isinstance(self.tokenizer, str) and names_default_model(self.tokenizer):
            # the default model's tokenizer: its own when it runs, else under its one name
            # (`resolve_tokenizer` finds its folder when the engine starts)
            self.tokenizer = None if self.model is None else DEFAULT_MODEL_ID
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.served_model_name is not None and (
            not isinstance(self.served_model_name, str) or not self.served_model_name.strip()
        ):
            raise ValueError(
                f"served_model_name must be a non-empty string or None, got "
                f"{self.served_model_name!r}"
            )
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be true or false, got {self.batch_invariant!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (
            not isinstance(sizes, list) or not sizes or not all(is_int(n) and n >= 1 for n in sizes)
        ):
            raise ValueError(
                f"cudagraph_capture_sizes must be a non-empty list of integers >= 1 or None, "
                f"got {sizes!r}"
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
            if not is_int(value) or (name != "seed" and value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in (
            "max_model_len",
            "num_gpu_blocks_override",
            "max_step_tokens",
            "max_num_seqs",
            "max_active_coroutines",
        ):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(
                    f"{name} must be an integer >= 1 (or unset/None for the default), "
                    f"got {value!r}"
                )
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
            is_number(self.kv_cache_memory_gb) and 0 < self.kv_cache_memory_gb < math.inf
        ):
            raise ValueError(
                f"kv_cache_memory_gb must be a finite number > 0 (GiB) or None, "
                f"got {self.kv_cache_memory_gb!r}"
            )
        if not (is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1):
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

    @property
    def resolved_capture_sizes(self) -> list[int]:
        """The CUDA graph capture sizes, ascending and distinct: ``cudagraph_capture_sizes``
        when given, else vLLM's default ``[1, 2, 4] + [8, 16, ...]`` up to
        ``min(max_num_seqs, 512)`` (`default_capture_sizes`)."""
        if self.cudagraph_capture_sizes is not None:
            return sorted(set(self.cudagraph_capture_sizes))
        return default_capture_sizes(self.max_running_seqs)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
