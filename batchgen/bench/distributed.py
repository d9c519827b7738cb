"""`batchgen bench --data-parallel-size N [--enable-expert-parallel] [--prefill-strategy ...]`:
the distributed path against one process, in one run, on the same workloads and checkpoint.

Modes: ``single`` (one process, all cores) and ``dp`` (N local ranks, cores and the KV cache
budget divided among them, the given parallel flags), both under the coalesce policy at the
engine's defaults (``--expert-coalesce-threshold`` replaces its threshold; each mode's
``engine_settings`` in ``--json`` name them). Reported per mode: useful tokens/s (wall time of
the generate call, rank start-up excluded) and its ratio to ``single``, tile density over
every expert GEMM, and per rank: tile density, all-to-all bytes and seconds, streamed bytes
and the hidden share of the streaming time, resident routed-expert bytes and peak RSS.

On a machine of 2 cores, 2 ranks of one thread cannot beat one process of 2 threads; the ratio
shows what the distributed path costs (issue target: DP2+EP2 >= 0.8x on rollouts).
"""

from __future__ import annotations

import gc
import logging
import time

from batchgen.bench.bench_model import engine_overrides, override_kwargs
from batchgen.bench.workloads import Workload, make_workloads

logger = logging.getLogger(__name__)

DIST_MODES = ("single", "dp")
PARALLEL_FLAGS = (
    "data_parallel_size",
    "enable_expert_parallel",
    "expert_parallel_size",
    "prefill_strategy",
    "decode_strategy",
    "prefill_stream_min_tokens",
    "stream_buffer_layers",
)


def _run_mode(
    path: str, workload: Workload, dtype: str, overrides: dict | None, kv_gb: float, parallel
):
    from batchgen import LLM, SamplingParams
    from batchgen.bench.batchgen_modes import engine_settings

    llm = LLM(
        path,
        dtype=dtype,
        device="cpu",
        scheduler_policy="coalesce",
        kv_cache_memory_gb=kv_gb,
        max_model_len=4096,
        **override_kwargs(overrides),
        **parallel,
    )
    try:
        warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        llm.generate([[1, 5, 6, 7]] * 4, warm, use_tqdm=False)
        llm.llm_engine.reset_metrics()
        params = [
            SamplingParams(
                n=r.n,
                max_tokens=r.output_len,
                ignore_eos=True,
                temperature=0.0 if r.n == 1 else 1.0,
                seed=None if r.n == 1 else i,
            )
            for i, r in enumerate(workload.requests)
        ]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        produced = sum(len(o.token_ids) for out in outs for o in out.outputs)
        m = llm.get_metrics()
        settings = engine_settings(llm.llm_engine.config)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    if produced != workload.useful_tokens:
        raise RuntimeError(f"produced {produced} tokens, expected {workload.useful_tokens}")
    ranks = m.get("ranks", [m])
    return {
        "tokens_per_s": produced / seconds,
        "seconds": seconds,
        "useful_tokens": produced,
        "tile_density": m["tile_density"],
        "num_preemptions": m["num_preemptions"],
        "engine_settings": settings,  # what every rank ran under (as the one-process bench's)
        "ranks": [
            {
                "tile_density": r["tile_density"],
                "generated_tokens": r["generated_tokens"],
                "all_to_all_bytes": r.get("all_to_all_bytes", 0),
                "all_to_all_seconds": r.get("all_to_all_seconds", 0.0),
                "all_to_all_wait_seconds": r.get("all_to_all_wait_seconds", 0.0),
                "control_seconds": r.get("control_seconds", 0.0),
                "streamed_bytes": r.get("streamed_bytes", 0),
                "stream_copy_seconds": r.get("stream_copy_seconds", 0.0),
                "stream_hidden_share": r.get("stream_hidden_share"),
                "resident_expert_bytes": r["routed_expert_bytes"],
                "peak_memory_bytes": r["peak_memory_bytes"],
                "busy_seconds": r["busy_seconds"],
                "dummy_steps": r.get("dummy_steps", 0),
                "moe_share": r["stage_time_share"].get("moe"),
                "attention_share": r["stage_time_share"].get("attention"),
            }
            for r in ranks
        ],
    }


def run_distributed(args, parallel: dict) -> dict:
    """Both modes on every selected workload; returns the ``--json`` record."""
    from transformers import AutoConfig

    from batchgen.bench import runner
    from batchgen.models.model_config import ModelConfig

    path = args.model or runner.bench_model_path(args.arch)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    kv_gb = runner.QUICK_KV_CACHE_GB if args.quick else runner.KV_CACHE_GB
    wanted = tuple(args.workloads.split(",")) if args.workloads else ("rollouts", "extraction")
    record = {
        "model": path,
        "dtype": args.dtype,
        "parallel": parallel,
        "kv_cache_memory_gb": kv_gb,
        "workloads": {},
    }
    for workload in make_workloads(
        cfg.vocab_size, args.quick, rollouts_requests=args.rollouts_requests
    ):
        if workload.name not in wanted:
            continue
        results = {}
        for mode in DIST_MODES:
            logger.info("%s/%s: running", workload.name, mode)
            try:
                results[mode] = _run_mode(
                    path,
                    workload,
                    args.dtype,
                    engine_overrides(args),
                    # The same KV memory in all: split among the ranks.
                    kv_gb / parallel["data_parallel_size"] if mode == "dp" else kv_gb,
                    parallel if mode == "dp" else {},
                )
            except Exception as exc:  # one failing mode must not lose the other's figures
                logger.warning("%s/%s failed: %s", workload.name, mode, exc)
                results[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        single = results["single"].get("tokens_per_s")
        dp = results["dp"].get("tokens_per_s")
        if single and dp:
            results["dp"]["ratio_to_single"] = dp / single
        record["workloads"][workload.name] = {"requests": len(workload.requests), **results}
    return record


def format_distributed(record: dict) -> str:
    """The table of a `run_distributed` record (one line per mode, one per rank)."""
    p = record["parallel"]
    lines = [
        f"model {record['model']} ({record['dtype']}); dp: "
        + ", ".join(f"{k}={v}" for k, v in p.items()),
        "legend: tok/s = useful generated tokens per second of the generate call; x single = "
        "ratio to one process; a2a = all-to-all payload sent by the rank to others and seconds "
        "in those collectives (of which in count exchanges); step sync = seconds in the per-step "
        "control exchange, waiting for the slowest rank; streamed = expert bytes "
        "streamed for data_parallel_offload and the share of that copy time hidden behind "
        "compute; experts = resident routed-expert weights",
        f"{'workload':<11} {'mode':<7} {'tok/s':>9} {'x single':>8} {'tile dens':>9} "
        f"{'secs':>8} {'preempt':>7}",
    ]
    for name, w in record["workloads"].items():
        for mode in DIST_MODES:
            r = w[mode]
            if "error" in r:
                lines.append(f"{name:<11} {mode:<7} failed: {r['error'][:200]}")
                continue
            ratio = f"{r['ratio_to_single']:.2f}" if "ratio_to_single" in r else "-"
            td = f"{r['tile_density']:.3f}" if r["tile_density"] is not None else "-"
            lines.append(
                f"{name:<11} {mode:<7} {r['tokens_per_s']:>9.1f} {ratio:>8} {td:>9} "
                f"{r['seconds']:>8.1f} {r['num_preemptions']:>7}"
            )
            if mode != "dp":
                continue
            for i, k in enumerate(r["ranks"]):
                hidden = k["stream_hidden_share"]
                streamed = (
                    f"streamed {k['streamed_bytes'] / 2**20:.0f} MiB ({hidden:.2f} hidden)"
                    if k["streamed_bytes"]
                    else "streamed 0"
                )
                ktd = f"{k['tile_density']:.3f}" if k["tile_density"] is not None else "-"
                lines.append(
                    f"  rank {i}: {k['generated_tokens']} tok, tile dens {ktd}, a2a "
                    f"{k['all_to_all_bytes'] / 2**20:.0f} MiB in {k['all_to_all_seconds']:.1f} s "
                    f"({k['all_to_all_wait_seconds']:.1f} s in count exchanges), "
                    f"step sync {k['control_seconds']:.1f} s,"
                    f" {streamed}, experts {k['resident_expert_bytes'] / 2**20:.0f} MiB, peak "
                    f"RSS {k['peak_memory_bytes'] / 2**30:.2f} GiB, dummy steps "
                    f"{k['dummy_steps']}"
                )
    return "\n".join(lines)
