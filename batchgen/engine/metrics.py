"""Run metrics: token throughput, expert GEMM shapes and tile density, time per stage, memory.

Tile density (DESIGN.md) is ``sum(m_e) / sum(ceil(m_e / T) * T)`` over every expert GEMM run,
``m_e`` the rows of expert e's GEMM and ``T`` the tile (64 rows by default): the share of
launched tile rows that carry a token.
"""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

# "grammar_mask": structured outputs' matcher work (each constrained row's allowed-token mask
# and advancing its grammar by the sampled token); applying the masks is part of "sampling".
STAGES = (
    "attention", "moe", "dense_ffn", "lm_head", "cuda_graph", "sampling", "grammar_mask",
    "scheduling",
)  # fmt: skip


@dataclass
class ExpertGemmStats:
    """Counts over expert GEMMs (one per non-empty expert per MoE call)."""

    tile_size: int = 64
    num_gemms: int = 0
    rows: int = 0
    tile_rows: int = 0
    num_moe_calls: int = 0

    def record(self, counts: list[int]) -> None:
        """Record one MoE call's rows per expert (a list of E ints)."""
        t = self.tile_size
        self.num_moe_calls += 1
        for m in counts:
            if m:
                self.num_gemms += 1
                self.rows += m
                self.tile_rows += -(-m // t) * t

    @property
    def mean_rows_per_gemm(self) -> float:
        return self.rows / self.num_gemms if self.num_gemms else 0.0

    @property
    def tile_density(self) -> float | None:
        return self.rows / self.tile_rows if self.tile_rows else None


@dataclass
class EngineMetrics:
    """Cumulative metrics of one engine. `snapshot` returns plain numbers.

    Stage times are wall-clock seconds measured around each stage call (on CUDA the executor
    synchronises before reading the clock, so the figures are honest, at a small cost).
    """

    tile_size: int = 64
    expert: ExpertGemmStats = field(default_factory=ExpertGemmStats)
    stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    num_steps: int = 0
    busy_seconds: float = 0.0  # time inside engine steps
    # Steps made only of decode tokens: the decode phase's own throughput and FLOP rate.
    decode_only_tokens: int = 0
    decode_only_seconds: float = 0.0
    decode_only_context_tokens: int = 0  # sum of the decoded tokens' context lengths
    decode_only_stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    shared_prefix_tokens: int = 0  # prompt positions taken from a sibling sample's KV blocks
    kv_imported_tokens: int = 0  # positions whose K/V were shipped from another rank
    cuda_graph_steps: int = 0  # steps run by CUDA graph replay (`batchgen.engine.cuda_graphs`)
    started_at: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.expert.tile_size = self.tile_size

    def reset(self) -> None:
        fresh = EngineMetrics(tile_size=self.tile_size)
        self.__dict__.update(fresh.__dict__)

    @staticmethod
    def peak_memory_bytes(device: torch.device) -> int:
        """Peak device memory on CUDA; peak resident set size of the process on CPU."""
        if device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(device))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)

    @staticmethod
    def _shares(stage_seconds: dict[str, float], total: float) -> dict[str, float]:
        """Each stage's share of ``total`` seconds; the unstaged rest is Python overhead."""
        total = total or 1e-12
        shares = {k: stage_seconds.get(k, 0.0) / total for k in STAGES}
        shares["python_overhead"] = max(0.0, total - sum(stage_seconds.values())) / total
        return shares

    def snapshot(self, device: torch.device) -> dict:
        """Throughput (tokens/s over busy time), expert GEMM stats, stage time shares."""
        busy = self.busy_seconds or 1e-12
        processed = self.prefill_tokens + self.decode_tokens
        return {
            "num_steps": self.num_steps,
            "busy_seconds": self.busy_seconds,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_tokens_per_s": self.prefill_tokens / busy,
            "decode_tokens_per_s": self.decode_tokens / busy,
            "total_tokens_per_s": processed / busy,
            "generated_tokens_per_s": self.generated_tokens / busy,
            "decode_only_tokens": self.decode_only_tokens,
            "decode_only_seconds": self.decode_only_seconds,
            "decode_only_mean_context": (
                self.decode_only_context_tokens / self.decode_only_tokens
                if self.decode_only_tokens
                else 0.0
            ),
            "decode_only_stage_time_share": self._shares(
                self.decode_only_stage_seconds, self.decode_only_seconds
            ),
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "kv_imported_tokens": self.kv_imported_tokens,
            "cuda_graph_step_share": self.cuda_graph_steps / (self.num_steps or 1),
            "num_expert_gemms": self.expert.num_gemms,
            "mean_rows_per_expert_gemm": self.expert.mean_rows_per_gemm,
            "tile_size": self.tile_size,
            "tile_density": self.expert.tile_density,
            "stage_time_share": self._shares(self.stage_seconds, self.busy_seconds),
            "peak_memory_bytes": self.peak_memory_bytes(device),
        }
