"""Job totals over the ranks' metric snapshots (`DPEngineClient.get_metrics`)."""

from __future__ import annotations


def aggregate_metrics(ranks: list[dict], wall_seconds: float) -> dict:
    """Job totals over per-rank metric snapshots (see `DPEngineClient.get_metrics`).

    Token and step counts are summed (``decode_only_step_tokens``, a histogram, by size:
    `merge_histograms`). Rates divide by the busiest rank's ``busy_seconds`` (time inside
    engine steps; ranks step side by side), as one process divides by its own: so the figures
    compare with `LLMEngine.get_metrics`. ``stage_time_share`` is the busy-time-weighted mean
    over the ranks that report one; ``wall_seconds`` is the time since start or
    the last `reset_metrics`.

    Raises:
        ValueError: a histogram size that is not a whole number (`merge_histograms`).
    """
    total = {
        key: sum(s.get(key, 0) for s in ranks)
        for key in (
            "prefill_tokens",
            "decode_tokens",
            "generated_tokens",
            "num_steps",
            "decode_only_tokens",
            "decode_only_steps",
            "num_preemptions",
            "num_expert_gemms",
            "routed_expert_bytes",
            "all_to_all_bytes",
            "streamed_bytes",
            "dummy_steps",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "prefix_cache_evictions",
        )
    }
    rows = sum(s["mean_rows_per_expert_gemm"] * s["num_expert_gemms"] for s in ranks)
    tile_rows = sum(
        s["mean_rows_per_expert_gemm"] * s["num_expert_gemms"] / s["tile_density"]
        for s in ranks
        if s.get("tile_density")
    )
    step_tokens = merge_histograms(ranks, "decode_only_step_tokens")
    busy = max(s["busy_seconds"] for s in ranks) or 1e-12
    staged = [s for s in ranks if s.get("stage_time_share")]
    weight_sum = sum(s["busy_seconds"] for s in staged) or 1e-12
    shares: dict[str, float] = {}
    for s in staged:
        for stage, share in s["stage_time_share"].items():
            shares[stage] = shares.get(stage, 0.0) + share * s["busy_seconds"] / weight_sum
    return {
        **total,
        "data_parallel_size": len(ranks),
        "decode_only_step_tokens": step_tokens,
        "busy_seconds": busy,
        "wall_seconds": wall_seconds,
        "prefill_tokens_per_s": total["prefill_tokens"] / busy,
        "decode_tokens_per_s": total["decode_tokens"] / busy,
        "generated_tokens_per_s": total["generated_tokens"] / busy,
        "total_tokens_per_s": (total["prefill_tokens"] + total["decode_tokens"]) / busy,
        "stage_time_share": shares,
        "prefix_cache_hit_rate": (
            total["prefix_cache_hits"] / total["prefix_cache_queries"]
            if total["prefix_cache_queries"]
            else 0.0
        ),
        "tile_density": rows / tile_rows if tile_rows else None,
        "mean_rows_per_expert_gemm": rows / total["num_expert_gemms"]
        if total["num_expert_gemms"]
        else 0.0,
        "peak_memory_bytes": max(s["peak_memory_bytes"] for s in ranks),
        "ranks": ranks,
    }


def merge_histograms(ranks: list[dict], key: str) -> dict[int, int]:
    """The sum over ``ranks`` of the histogram at ``key`` (size -> count), sorted by size.

    A snapshot that crossed JSON has its sizes as strings ("4"), one that stayed in Python as
    ints (4): both are the size 4. A rank whose histogram is None or absent adds nothing.

    Raises:
        ValueError: a size that is not a whole number, naming the rank (its ``rank`` field, else
            its place in ``ranks``) and ``key``.
    """
    merged: dict[int, int] = {}
    for place, snapshot in enumerate(ranks):
        for size, count in (snapshot.get(key) or {}).items():
            try:
                tokens = int(size)
                whole = tokens == float(size)  # 4.5 is not size 4
            except (TypeError, ValueError, OverflowError):
                whole = False
            if not whole:
                rank = snapshot.get("rank", place)
                raise ValueError(
                    f"rank {rank}'s {key}: size {size!r} is not a whole number"
                ) from None
            merged[tokens] = merged.get(tokens, 0) + count
    return dict(sorted(merged.items()))
