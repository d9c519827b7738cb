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


def _rank_snapshot(step_sizes: dict[int, int], busy: float = 1.0) -> dict:
    """A real `EngineMetrics.snapshot` of a rank that ran ``step_sizes`` (tokens in a
    decode-only step -> how many such steps)."""
    import torch

    from batchgen.engine.metrics import EngineMetrics

    m = EngineMetrics()
    for tokens, steps in step_sizes.items():
        m.decode_only_step_tokens[tokens] += steps
        m.decode_only_steps += steps
        m.decode_only_tokens += tokens * steps
    m.decode_tokens = m.generated_tokens = m.decode_only_tokens
    m.num_steps = m.decode_only_steps
    m.busy_seconds = busy
    return m.snapshot(torch.device("cpu"))


def test_histograms_merge_by_size_whatever_the_key_type_or_a_missing_one():
    """One rank's snapshot as it is (int keys), one through JSON (str keys: "4", "10"), one
    through pickle, one with no histogram (None): sizes merge as numbers, sorted as numbers
    (10 after 7, not after 1), and the merged histogram adds up to the summed counts."""
    import json
    import pickle

    from batchgen.distributed.metrics import aggregate_metrics

    as_is = _rank_snapshot({1: 2, 4: 3, 10: 1})
    via_json = json.loads(json.dumps(_rank_snapshot({4: 5, 7: 1, 10: 2}, busy=2.0)))
    assert set(via_json["decode_only_step_tokens"]) == {"4", "7", "10"}
    via_pickle = pickle.loads(pickle.dumps(_rank_snapshot({2: 1})))
    none = {**_rank_snapshot({}), "decode_only_step_tokens": None, "stage_time_share": None}
    m = aggregate_metrics([as_is, via_json, via_pickle, none], 3.0)
    assert m["decode_only_step_tokens"] == {1: 2, 2: 1, 4: 8, 7: 1, 10: 3}
    assert list(m["decode_only_step_tokens"]) == [1, 2, 4, 7, 10]
    assert m["decode_only_steps"] == 2 + 3 + 1 + 5 + 1 + 2 + 1 == 15
    assert m["decode_only_tokens"] == 2 + 12 + 10 + 20 + 7 + 20 + 2 == 73
    assert m["decode_only_steps"] == sum(m["decode_only_step_tokens"].values())
    assert m["decode_only_tokens"] == sum(k * n for k, n in m["decode_only_step_tokens"].items())
    assert m["decode_tokens"] == 73 and m["decode_tokens_per_s"] == 73 / 2.0
    assert m["data_parallel_size"] == 4
    # No stage ran inside these steps: all of each rank's busy time is Python overhead, and
    # the rank without a breakdown does not dilute that.
    assert m["stage_time_share"]["python_overhead"] == pytest.approx(1.0)
    assert m["stage_time_share"]["attention"] == 0.0


def test_a_histogram_size_that_is_not_a_number_names_the_rank_and_field():
    from batchgen.distributed.metrics import aggregate_metrics

    for size in ("four", 4.5, None):
        bad = {**_rank_snapshot({4: 1}), "decode_only_step_tokens": {size: 1}, "rank": 3}
        with pytest.raises(
            ValueError, match=rf"rank 3's decode_only_step_tokens: size {size!r} is not a whole"
        ):
            aggregate_metrics([_rank_snapshot({4: 1}), bad], 1.0)
