"""`aggregate_metrics`: job totals over the ranks' `get_metrics` snapshots, as
`DPEngineClient.get_metrics` returns them. Pure Python on plain dicts (and real
`EngineMetrics` snapshots), milliseconds."""

from __future__ import annotations

import pytest


def test_aggregate_rates_use_the_busiest_ranks_busy_time():
    from batchgen.distributed.frontend import aggregate_metrics

    def snap(busy, generated, gemms, rows, density, attention):
        return {
            "prefill_tokens": 10,
            "decode_tokens": generated,
            "generated_tokens": generated,
            "num_steps": 3,
            "num_preemptions": 0,
            "num_expert_gemms": gemms,
            "routed_expert_bytes": 100,
            "mean_rows_per_expert_gemm": rows,
            "tile_density": density,
            "busy_seconds": busy,
            "peak_memory_bytes": 5,
            "stage_time_share": {"attention": attention, "moe": 1 - attention},
        }

    m = aggregate_metrics(
        [snap(2.0, 40, 10, 8.0, 0.5, 0.2), snap(4.0, 60, 30, 16.0, 0.25, 0.5)], 99
    )
    assert m["busy_seconds"] == 4.0
    assert m["generated_tokens_per_s"] == 100 / 4.0
    assert m["decode_tokens_per_s"] == 100 / 4.0
    # tile density over all GEMMs: rows 80 + 480 over tile rows 160 + 1920
    assert m["tile_density"] == pytest.approx(560 / 2080)
    assert m["stage_time_share"]["attention"] == pytest.approx((0.2 * 2 + 0.5 * 4) / 6)
    assert m["wall_seconds"] == 99


def test_aggregate_sums_decode_only_steps_and_merges_their_histogram():
    from batchgen.distributed.metrics import aggregate_metrics

    def snap(hist: dict[int, int]) -> dict:
        return {
            "decode_only_tokens": sum(n * k for n, k in hist.items()),
            "decode_only_steps": sum(hist.values()),
            "decode_only_step_tokens": hist,
            "num_expert_gemms": 0,
            "mean_rows_per_expert_gemm": 0.0,
            "tile_density": None,
            "busy_seconds": 1.0,
            "peak_memory_bytes": 5,
            "stage_time_share": {},
        }

    m = aggregate_metrics([snap({1: 2, 4: 3}), snap({4: 5, 7: 1}), snap({})], 1.0)
    assert m["decode_only_step_tokens"] == {1: 2, 4: 8, 7: 1}
    assert list(m["decode_only_step_tokens"]) == [1, 4, 7]  # sorted, as one rank's
    assert m["decode_only_steps"] == 11
    assert m["decode_only_tokens"] == 2 + 12 + 20 + 7
