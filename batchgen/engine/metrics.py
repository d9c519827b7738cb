"""Run metrics: token throughput, expert GEMM shapes and tile density, time per stage, memory.

Tile density (DESIGN.md) is ``sum(m_e) / sum(ceil(m_e / T) * T)`` over every expert GEMM run,
``m_e`` the rows of expert e's GEMM and ``T`` the tile (64 rows by default): the share of
launched tile rows that carry a token.
"""

from __future__ import annotations

import functools
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
    """Counts over expert GEMMs (one per non-empty expert per MoE call).

    Host paths record a Python list of rows per expert (`record`); the CUDA paths record the
    counts as a device tensor (`record_device`), accumulated on the device and read once, by
    `flush` (the engine calls it after each step's sampling, when the stream is already idle),
    so that no MoE layer syncs with the host for its statistics.
    """

    tile_size: int = 64
    num_gemms: int = 0
    rows: int = 0
    tile_rows: int = 0
    num_moe_calls: int = 0
    # [3] int64 on the device: (num_gemms, rows, tile_rows) recorded since the last `flush`
    _pending: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def record(self, counts: list[int]) -> None:
        """Record one MoE call's rows per expert (a list of E ints)."""
        t = self.tile_size
        self.num_moe_calls += 1
        for m in counts:
            if m:
                self.num_gemms += 1
                self.rows += m
                self.tile_rows += -(-m // t) * t

    def record_device(self, counts: torch.Tensor) -> None:
        """Record MoE calls from rows per expert on the device, without a host sync:
        ``counts [E]`` (one call) or ``[L, E]`` (L calls), any integer dtype. The totals reach
        ``num_gemms``, ``rows`` and ``tile_rows`` at the next `flush`."""
        t = self.tile_size
        counts = counts.to(torch.int64)
        self.num_moe_calls += 1 if counts.dim() == 1 else counts.shape[0]
        totals = torch.stack(
            ((counts > 0).sum(), counts.sum(), ((counts + t - 1) // t * t).sum())
        )  # [3]
        # out of place: the sum may be an inference tensor, and a later call may run outside
        # inference mode
        self._pending = totals if self._pending is None else self._pending + totals

    def flush(self) -> None:
        """Add the device-side records to the host counts (one device-to-host read; a no-op
        when nothing is pending)."""
        if self._pending is None:
            return
        num_gemms, rows, tile_rows = self._pending.tolist()
        self._pending = None
        self.num_gemms += num_gemms
        self.rows += rows
        self.tile_rows += tile_rows

    @property
    def mean_rows_per_gemm(self) -> float:
        return self.rows / self.num_gemms if self.num_gemms else 0.0

    @property
    def tile_density(self) -> float | None:
        return self.rows / self.tile_rows if self.tile_rows else None


class StageTimer:
    """Seconds per stage into ``metrics.stage_seconds`` without a host sync on CUDA.

    On CPU a stage's time is ``time.perf_counter()`` around it. On CUDA the clock is a pair of
    timing events recorded on the current stream around the stage's launches; `flush` (after
    the step's sampling, when the stream has drained) adds ``start.elapsed_time(end)``: the
    stream's time from the stage's first launch to its last kernel's end (idle gaps while
    the host launches included). Before, the executor called ``torch.cuda.synchronize()``
    at every clock read: two host syncs per layer per step.

    Args:
        metrics: receives the seconds (`EngineMetrics`; read at each stop or flush, so a
            `EngineMetrics.reset` is seen).
        device: CPU or CUDA.
        event_factory: makes a timing event (``record()``, ``synchronize()``,
            ``elapsed_time(end)`` in ms); default ``torch.cuda.Event(enable_timing=True)`` on
            CUDA. Tests inject one on CPU.
    """

    def __init__(self, metrics, device: torch.device, event_factory=None) -> None:
        self.metrics = metrics
        if event_factory is None and device.type == "cuda":
            event_factory = functools.partial(torch.cuda.Event, enable_timing=True)
        self.event_factory = event_factory
        self.pending: list[tuple[str, object, object]] = []

    def start(self):
        """A stage starts now: returns the token to pass to `stop`."""
        if self.event_factory is None:
            return time.perf_counter()
        event = self.event_factory()
        event.record()
        return event

    def stop(self, stage: str, start) -> None:
        """The stage begun at ``start`` ends now (its seconds counted now on CPU, at `flush`
        on CUDA)."""
        if self.event_factory is None:
            self.metrics.stage_seconds[stage] += time.perf_counter() - start
            return
        end = self.event_factory()
        end.record()
        self.pending.append((stage, start, end))

    def flush(self) -> None:
        """Count the stages timed by events (waits for the last one: call it when the step's
        work has been waited for anyway)."""
        if not self.pending:
            return
        self.pending[-1][2].synchronize()
        for stage, start, end in self.pending:
            self.metrics.stage_seconds[stage] += start.elapsed_time(end) / 1000.0
        self.pending.clear()


@dataclass
class EngineMetrics:
    """Cumulative metrics of one engine. `snapshot` returns plain numbers.

    Stage times are wall-clock seconds measured around each stage call (on CUDA by timing
    events read after the step's sampling, `StageTimer`: no host sync inside the step).
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
    decode_only_steps: int = 0
    # tokens in a decode-only step -> how many such steps (the decode roofline's weight reads)
    decode_only_step_tokens: dict[int, int] = field(default_factory=lambda: defaultdict(int))
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
        """Zero every count. ``expert`` is reset in place, not replaced: the MoE layers and the
        CUDA graph runner hold it and record into it (a replaced one lost their records)."""
        fresh = EngineMetrics(tile_size=self.tile_size)
        self.expert.__dict__.update(fresh.expert.__dict__)
        fresh.expert = self.expert
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
        self.expert.flush()
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
            "decode_only_steps": self.decode_only_steps,
            "decode_only_step_tokens": dict(sorted(self.decode_only_step_tokens.items())),
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
