"""What one benchmark mode returns (`ModeResult`), and the progress bar every mode shows."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.bench.workloads import TreeSearch, Workload


@dataclass
class ModeResult:
    tokens_per_s: float
    seconds: float
    useful_tokens: int
    mfu: float
    tile_density: float | None = None
    decode_mfu: float | None = None
    mean_rows_per_expert_gemm: float | None = None
    num_expert_gemms: int | None = None
    extra: dict = field(default_factory=dict)


def _progress(workload: Workload | TreeSearch, mode: str, enabled: bool):
    """A tqdm bar on stderr over the useful tokens of ``mode`` on ``workload``."""
    from tqdm import tqdm

    return tqdm(
        total=workload.useful_tokens,
        desc=f"{workload.name}/{mode}",
        unit="tok",
        disable=not enabled,
        dynamic_ncols=True,
        leave=True,
    )
