"""Job totals over the ranks' metric snapshots (`DPEngineClient.get_metrics`)."""

from __future__ import annotations


def aggregate_metrics(ranks: list[dict], wall_seconds: float) -> dict:
    """Job totals over per-rank metric snapshots (see `DPEngineClient.get_metrics`).

    Token and step counts are summed (``decode_only_step_tokens``, a histogram, by key: the
    number of decode-only steps of each size over all ranks). Rates divide by the busiest
    rank's ``busy_seconds`` (time inside engine steps; ranks step side by side), as one process
    divides by its own: so the figures compare with `LLMEngine.get_metrics`. ``stage_time_share`` is the busy-time-weighted mean
    over ranks; ``wall_seconds`` is the time since start or the last `reset_metrics`.
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
    step_tokens: dict[int, int] = {}
    for s in ranks:
        for tokens, steps in s.get("decode_only_step_tokens", {}).items():
            step_tokens[tokens] = step_tokens.get(tokens, 0) + steps
    busy = max(s["busy_seconds"] for s in ranks) or 1e-12
    weights = [s["busy_seconds"] for s in ranks]
    shares: dict[str, float] = {}
    for s, weight in zip(ranks, weights, strict=True):
        for stage, share in s["stage_time_share"].items():
            shares[stage] = shares.get(stage, 0.0) + share * weight / (sum(weights) or 1e-12)
    return {
        **total,
        "data_parallel_size": len(ranks),
        "decode_only_step_tokens": dict(sorted(step_tokens.items())),
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
