"""The benchmark's human-readable table (`format_table`) of a `batchgen.bench.runner.run`
record, with its legend."""

from __future__ import annotations

from batchgen.bench.args import MODES


def _settings_lines(record: dict) -> list[str]:
    """One line per BatchGen mode of the run: the engine settings it ran under (its first
    workload's ``extra.engine_settings``)."""
    lines = []
    for mode in ("lockstep", "coalesce"):
        settings = next(
            (
                w[mode]["extra"]["engine_settings"]
                for w in record["workloads"].values()
                if "engine_settings" in w.get(mode, {}).get("extra", {})
            ),
            None,
        )
        if settings is None:
            continue
        lines.append(
            f"  {mode}: max_num_batched_tokens {settings['max_num_batched_tokens']}, "
            f"max_num_seqs {settings['max_num_seqs']}, {settings['max_step_tokens']} tokens per "
            f"step, expert_coalesce_threshold {settings['expert_coalesce_threshold']}, "
            f"block_size {settings['block_size']}, KV cache {settings['kv_cache_memory_gb']} "
            f"GiB ({settings.get('kv_cache_dtype', 'auto')}), "
            f"max_model_len {settings['max_model_len']}"
        )
    return lines


def format_table(record: dict) -> str:
    """Human-readable table of a `run` record."""
    settings = _settings_lines(record)
    lines = [
        f"peak {record['peak_gflops']:.1f} GFLOP/s ({record['dtype']}, {record['device']},"
        f" {record['torch_threads']} threads)"
        + (f", memory read {record['read_gbps']:.1f} GB/s" if record.get("read_gbps") else "")
        + ("; engine settings:" if settings else ""),
        *settings,
        f"{'workload':<11} {'mode':<18} {'tok/s':>9} {'x hf_gen':>8} {'tile dens':>9} "
        f"{'rows/GEMM':>9} {'MFU':>6} {'dec MFU':>7} {'secs':>7}",
    ]
    for name, w in record["workloads"].items():
        base = w.get("hf_generate", {}).get("tokens_per_s")
        for mode in MODES:
            if mode not in w:
                continue
            r = w[mode]
            if "error" in r:
                lines.append(f"{name:<11} {mode:<18} failed: {r['error'][:200]}")
                continue
            ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
            td = f"{r['tile_density']:.3f}" if r["tile_density"] is not None else "-"
            rows = (
                f"{r['mean_rows_per_expert_gemm']:.1f}"
                if r["mean_rows_per_expert_gemm"] is not None
                else "-"
            )
            dm = f"{r['decode_mfu']:.3f}" if r["decode_mfu"] is not None else "-"
            label = mode + ("*" if _sampled(w, mode) else "")
            lines.append(
                f"{name:<11} {label:<18} {r['tokens_per_s']:>9.1f} {ratio:>8} {td:>9} "
                f"{rows:>9} {r['mfu']:>6.3f} {dm:>7} {r['seconds']:>7.1f}"
            )
    lines += _legend(record)
    over = [
        f"{name}/{mode}"
        for name, w in record["workloads"].items()
        for mode in MODES
        if mode in w and "error" not in w[mode] and (w[mode].get("mfu") or 0) > 1.0
    ]
    if over:
        lines.append(
            f"MFU above 1 ({', '.join(over)}): the measured matmul peak "
            f"({record['peak_gflops']:.1f} GFLOP/s in {record['dtype']}) is below what the "
            "engine reached, so its MFU, decode MFU and roofline mean little here (torch's "
            "float16 matmul on a CPU is one such case)"
        )
    structured = record.get("structured", {}).get("extraction-json")
    if structured is not None:
        from batchgen.bench.structured import format_extraction_json

        if "error" in structured:
            lines.append(f"extraction-json failed: {structured['error'][:200]}")
        else:
            lines += format_extraction_json(structured)
    for name, w in record["workloads"].items():
        for mode in MODES:
            extra = w.get(mode, {}).get("extra", {})
            if extra.get("decode_only_seconds"):
                shares = extra.get("decode_only_stage_time_share", {})
                stages = ", ".join(f"{k} {v:.2f}" for k, v in shares.items() if v >= 0.005)
                lines.append(
                    f"decode-only {name}/{mode}: {extra['decode_only_tokens']} tokens in "
                    f"{extra['decode_only_seconds']:.1f} s (stage shares: {stages})"
                )
                roof = extra.get("decode_roofline")
                if roof:
                    lines += _roofline_lines(roof)
    for name, w in record["workloads"].items():
        for mode in MODES:
            extra = w.get(mode, {}).get("extra", {})
            off = extra.get("without_prefix_caching")
            if off:
                lines.append(
                    f"prefix caching {name}/{mode}: {w[mode]['tokens_per_s']:.1f} tok/s on "
                    f"({extra['prefill_tokens']} prefill tokens, hit rate "
                    f"{extra['prefix_cache_hit_rate']:.2f}) against {off['tokens_per_s']:.1f} "
                    f"off ({off['prefill_tokens']} prefill tokens): "
                    f"{w[mode]['tokens_per_s'] / off['tokens_per_s']:.2f}x, greedy tokens "
                    f"{'identical' if off['same_greedy_tokens'] else 'DIFFERENT'}"
                )
    for name, w in record["workloads"].items():
        for mode in MODES:
            top = w.get(mode, {}).get("extra", {}).get("profile_top_ops")
            if not top:
                continue
            extra = w[mode]["extra"]
            counts = extra.get("profiled_step_counts", {})
            for title, ops, key, which, over in (
                ("profile", top, "stage_time_share", "all", "the whole run's"),
                ("profile of the decode-only steps,", extra.get("profile_top_ops_decode_only"),
                 "decode_only_stage_time_share", "decode_only", "all decode-only steps'"),
            ):
                if not ops:
                    continue
                r_shares = extra.get(key, {})
                stages = ", ".join(f"{k} {v:.2f}" for k, v in r_shares.items() if v >= 0.005)
                traced = f"{counts[which]} steps traced; " if which in counts else ""
                lines.append(
                    f"\n{title} {name}/{mode} ({traced}{over} stage time shares: {stages})"
                )
                lines.append(f"  {'operator':<52} {'self s':>8} {'share':>6} {'calls':>8}")
                for op in ops:
                    lines.append(
                        f"  {op['name'][:52]:<52} {op['self_s']:>8.2f} {op['share']:>6.3f} "
                        f"{op['calls']:>8}"
                    )
    return "\n".join(lines)


def _roofline_lines(roof: dict) -> list[str]:
    """The ``roofline`` line under a mode's ``decode-only`` line (`batchgen.bench.roofline`),
    and what a fraction above 1 can mean."""
    frac = roof["decode_roofline_fraction"]
    lines = [
        f"  roofline {roof['roofline_s']:.3g} s (weight multiplies {roof['matmul_s']:.3g} s, "
        f"{roof['matmul_memory_bound_steps']} of {roof['steps']} steps bound by their weight "
        f"reads; attention {roof['attention_s']:.3g} s {roof['attention_bound']}-bound reading "
        f"{roof['kv_gb']:.3g} GB of K/V): decode at "
        + (f"{frac:.2f}" if frac is not None else "-")
        + f" of it; decode MFU ceiling {roof['decode_mfu_ceiling']:.3f} (docs/bench.md)"
    ]
    if frac is not None and frac > 1.0:
        lines.append(
            "  (above 1: the engine beat the estimate: routing more skewed than uniform, "
            "weights or K/V held in cache, or a measured peak or bandwidth below what the "
            "engine's kernels reach)"
        )
    return lines


def _sampled(workload: dict, mode: str) -> bool:
    """Whether ``mode`` ran on fewer requests than ``workload`` (a record's entry) has."""
    taken = workload.get(mode, {}).get("extra", {}).get("sampled_requests")
    return taken is not None and taken < workload["requests"]


def _legend(record: dict) -> list[str]:
    """The table's column legend, and which rows ran on a sample of their workload."""
    samples = [
        f"{name}/{mode} {w[mode]['extra']['sampled_requests']} of {w['requests']} requests"
        for name, w in record["workloads"].items()
        for mode in MODES
        if _sampled(w, mode)
    ]
    lines = [
        "",
        "tok/s      useful tokens per second (each sample's requested output tokens)",
        "x hf_gen   tok/s over hf_generate's on the same workload (- without hf_generate)",
        "tile dens  share of launched expert-GEMM tile rows (64) that carry a token: "
        "sum(m_e) / sum(ceil(m_e/64)*64)",
        "rows/GEMM  mean rows (token activations) per expert GEMM",
        "MFU        model FLOPs of the useful work (a shared prompt counted once) per second, "
        "over the measured matmul peak",
        "dec MFU    the same over the decode-only steps",
        "secs       the mode's wall time on its workload, or on its sample",
    ]
    if samples:
        lines.append(
            "*          ran on a sample, the workload's first requests, and reports that "
            "sample's rate: " + ", ".join(samples)
        )
    return lines
