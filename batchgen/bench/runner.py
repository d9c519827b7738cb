"""Run the benchmark: every workload through every mode, in one process, on one checkpoint.

Modes:
- ``hf_generate``: `transformers` ``generate`` in static batches of 64 sequences, left-padded,
  each batch running until its longest member is done (the common offline recipe).
- ``hf_generate_batch``: `transformers` ``generate_batch`` (its continuous batching); it takes
  one ``max_new_tokens`` per call, so requests are bucketed by output length (powers of two).
- ``lockstep`` / ``coalesce``: BatchGen's two executor policies under the same
  ``max_num_batched_tokens`` (512) and KV budget.

The ``extraction-json`` workload (structured outputs, `batchgen.bench.structured`) runs apart:
constrained against unconstrained on one BatchGen engine (coalesce when it is among the modes,
else lockstep), in the record's ``structured`` entry.

Only useful tokens count (each sample's requested output length); padding and over-generation
do not. The two `transformers` modes run on a sample of each workload, its first requests
(128 / 64 sequences, 64 / 16 with ``--quick``): their tokens/s is a rate, and 4,096 rollouts
would take `generate` over an hour (see `_hf_sample`). Greedy for ``n`` = 1, seeded sampling
for the ``search`` workload's ``n`` = 16.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict

import torch

from batchgen.bench.args import MODES, add_arguments  # noqa: F401  (re-exported for the CLI)
from batchgen.bench.flops import measure_peak_gflops, sequence_flops
from batchgen.bench.roofline import decode_roofline, measure_read_gbps
from batchgen.bench.workloads import (
    TreeSearch,
    Workload,
    make_shared_docs,
    make_tree_search,
    make_workloads,
)

from batchgen.bench.results import ModeResult, _progress  # noqa: F401  (re-exported)
from batchgen.bench.hf_modes import (  # noqa: F401  (re-exported)
    HF_SEQUENCES,
    _hf_model,
    _hf_sample,
    run_hf_generate,
    run_hf_generate_batch,
)
from batchgen.bench.report import format_table  # noqa: F401  (re-exported)
from batchgen.bench.bench_model import (  # noqa: F401  (re-exported)
    BENCH_MODEL,
    BENCH_MODEL_NAME,
    BENCH_MODELS,
    HF_BATCH_TOKENS,
    KV_CACHE_GB,
    QUICK_KV_CACHE_GB,
    bench_model_path,
    engine_overrides,
    override_kwargs,
)
from batchgen.bench.batchgen_modes import run_batchgen  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


def _coalesce_defaults(overrides: dict | None) -> dict:
    """The record's engine settings: the coalesce mode's `LLM()` defaults
    (`batchgen.config.EngineConfig`) with ``overrides`` (`override_kwargs`). Each BatchGen mode's own settings are in its ``extra["engine_settings"]``."""
    from batchgen.config import EngineConfig

    c = EngineConfig(
        scheduler_policy="coalesce",
        **override_kwargs(overrides),
    )
    return {
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "expert_coalesce_threshold": c.expert_coalesce_threshold,
        "max_num_seqs": c.max_running_seqs,  # the per-mode settings' name (vLLM's)
        "max_active_coroutines": c.max_running_seqs,  # the same, its former key here
        "max_step_tokens": c.step_token_budget,
        "kv_cache_dtype": c.kv_cache_dtype,
    }


def _workload_flops(cfg, workload: Workload | TreeSearch) -> int:
    return sum(sequence_flops(cfg, p, o, n) for p, o, n in workload.shapes())


def run(
    quick: bool = False,
    dtype: str = "float32",
    device: str = "cpu",
    modes: tuple[str, ...] = MODES,
    workloads: tuple[str, ...] | None = None,
    overrides: dict | None = None,
    model: str | None = None,
    profile: bool = False,
    arch: str = "mixtral",
    rollouts_requests: int | None = None,
    progress: bool = False,
) -> dict:
    """Run the benchmark; returns the ``--json`` record (see `format_table`). ``progress``:
    a tqdm bar per mode on stderr, over the useful tokens."""
    from batchgen.engine.engine_setup import resolve_device
    from batchgen.models.loader import _DTYPES

    dev = resolve_device(device)
    torch_dtype = _DTYPES[dtype]
    path = model or bench_model_path(arch)
    peak = measure_peak_gflops(torch_dtype, dev)
    read_gbps = measure_read_gbps(dev)
    record: dict = {
        "peak_gflops": peak,
        "read_gbps": read_gbps,
        "dtype": dtype,
        "device": str(dev),
        "model": path,
        "quick": quick,
        **_coalesce_defaults(overrides),
        "torch_threads": torch.get_num_threads(),
        "profiled": profile,
        "workloads": {},
    }
    from transformers import AutoConfig

    from batchgen.models.model_config import ModelConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    kv_gb = QUICK_KV_CACHE_GB if quick else KV_CACHE_GB
    record["kv_cache_memory_gb"] = kv_gb
    hf_cache: list = []

    def hf_model():
        if not hf_cache:
            hf_cache.append(_hf_model(path, torch_dtype, str(dev)))
        return hf_cache[0]

    chosen: list[Workload | TreeSearch] = list(
        make_workloads(cfg.vocab_size, quick, rollouts_requests=rollouts_requests)
    )
    if workloads and "shared-docs" in workloads:  # only when named
        chosen.append(make_shared_docs(cfg.vocab_size, quick))
    if workloads and "tree-search" in workloads:  # only when named
        chosen.append(make_tree_search(cfg.vocab_size, quick))
    for workload in chosen:
        if workloads and workload.name not in workloads:
            continue
        flops = _workload_flops(cfg, workload)
        results: dict[str, dict] = {}
        logger.info(
            "%s: %d requests, %d sequences, %d prompt tokens, %d useful tokens",
            workload.name,
            workload.num_requests,
            workload.num_sequences,
            workload.prompt_tokens,
            workload.useful_tokens,
        )
        for mode in modes:
            if isinstance(workload, TreeSearch) and mode not in ("lockstep", "coalesce"):
                # Its prompts come from the engine's outputs: BatchGen modes only.
                logger.info("%s/%s: skipped (BatchGen modes only)", workload.name, mode)
                continue
            logger.info("%s/%s: running", workload.name, mode)
            try:
                results[mode] = _run_mode(
                    mode,
                    path,
                    workload,
                    cfg,
                    flops,
                    quick,
                    dtype,
                    device,
                    overrides,
                    profile,
                    kv_gb,
                    hf_model,
                    progress,
                )
            except Exception as exc:  # one failing mode must not lose the others' figures
                logger.warning("%s/%s failed: %s", workload.name, mode, exc)
                results[mode] = {"error": f"{type(exc).__name__}: {exc}", "tokens_per_s": None}
                continue
            logger.info(
                "%s/%s: %.1f useful tokens/s in %.1f s",
                workload.name,
                mode,
                results[mode]["tokens_per_s"],
                results[mode]["seconds"],
            )
        record["workloads"][workload.name] = {
            "requests": workload.num_requests,
            "prompt_tokens": workload.prompt_tokens,
            "useful_tokens": workload.useful_tokens,
            **results,
        }
    policy = next((m for m in ("coalesce", "lockstep") if m in modes), None)
    if policy is not None and (not workloads or "extraction-json" in workloads):
        from batchgen.bench.structured import run_extraction_json

        logger.info("extraction-json: constrained and unconstrained (%s)", policy)
        engine_kwargs = dict(
            dtype=dtype,
            device=device,
            kv_cache_memory_gb=kv_gb,
            max_model_len=4096,
            **override_kwargs(overrides),
        )
        try:
            record["structured"] = {
                "extraction-json": run_extraction_json(
                    path, quick, policy, engine_kwargs, cfg.vocab_size
                )
            }
        except Exception as exc:  # the other workloads' figures stand
            logger.warning("extraction-json failed: %s", exc)
            record["structured"] = {"extraction-json": {"error": f"{type(exc).__name__}: {exc}"}}
    return _finish_record(record, torch_dtype, dev, peak, cfg)


def _run_mode(
    mode,
    path,
    workload,
    cfg,
    flops,
    quick,
    dtype,
    device,
    overrides,
    profile,
    kv_gb,
    hf_model,
    progress=False,
) -> dict:
    """One mode on one workload: the `ModeResult` as a dict (MFU filled in later)."""
    if mode in ("lockstep", "coalesce"):
        res, greedy = run_batchgen(
            path, workload, mode, dtype, device, overrides, profile, kv_gb, progress
        )
        if workload.name in ("shared-docs", "tree-search"):  # again without the prefix cache
            off, greedy_off = run_batchgen(
                path, workload, mode, dtype, device, overrides, False, kv_gb, progress, False
            )
            res.extra["without_prefix_caching"] = {
                "tokens_per_s": off.tokens_per_s,
                "seconds": off.seconds,
                "prefill_tokens": off.extra["prefill_tokens"],
                "same_greedy_tokens": greedy_off == greedy,
            }
        mode_flops = flops
    else:
        hf = hf_model()
        sample = _hf_sample(workload, quick, mode)
        res = (
            run_hf_generate(hf, sample, progress=progress)
            if mode == "hf_generate"
            else run_hf_generate_batch(hf, sample, HF_BATCH_TOKENS, progress=progress)
        )
        res.extra["sampled_requests"] = len(sample.requests)
        mode_flops = _workload_flops(cfg, sample)
    res.extra["useful_flops"] = mode_flops
    return asdict(res)


def _finish_record(
    record: dict, torch_dtype: torch.dtype, dev: torch.device, peak: float, cfg
) -> dict:
    """Fill in every successful mode's MFU, decode MFU and decode roofline
    (`batchgen.bench.roofline`) against the better of two peaks and two bandwidths."""
    # The matmul peak and the read bandwidth move with the machine's load: measure them again
    # at the end and divide by the better of the two, so a slow first measurement cannot
    # inflate every MFU or roofline fraction.
    end_peak = measure_peak_gflops(torch_dtype, dev)
    record["peak_gflops_measurements"] = [peak, end_peak]
    peak = record["peak_gflops"] = max(peak, end_peak)
    end_gbps = measure_read_gbps(dev)
    record["read_gbps_measurements"] = [record["read_gbps"], end_gbps]
    read_gbps = record["read_gbps"] = max(record["read_gbps"], end_gbps)
    for w in record["workloads"].values():
        for mode in MODES:
            if mode not in w or "error" in w[mode]:
                continue
            r = w[mode]
            r["mfu"] = r["extra"]["useful_flops"] / r["seconds"] / (peak * 1e9)
            if "decode_flops_per_s" in r["extra"]:
                r["decode_mfu"] = r["extra"].pop("decode_flops_per_s") / (peak * 1e9)
            e = r["extra"]
            if e.get("decode_only_step_tokens"):
                e["decode_roofline"] = decode_roofline(
                    cfg,
                    step_tokens=e["decode_only_step_tokens"],
                    mean_context=e["decode_only_mean_context"],
                    seconds=e["decode_only_seconds"],
                    weight_itemsize=e.pop("weight_itemsize"),
                    kv_itemsize=e.pop("kv_itemsize"),
                    peak_gflops=peak,
                    read_gbps=read_gbps,
                )
    return record


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="batchgen bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def _usage_error(message: str) -> None:
    """A bad flag or cluster file: the message on stderr and exit status 2 (argparse's and
    ``batchgen run``'s for usage errors), before anything loads."""
    print(f"batchgen bench: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_kv_cache_dtype(args, modes: tuple[str, ...]) -> None:
    """A usage error (exit 2) for a ``--kv-cache-dtype`` the bench's model refuses (an MLA
    model takes only auto), before any mode runs: else the hf modes run first and every
    BatchGen mode then fails with the engine's error."""
    kv = getattr(args, "kv_cache_dtype", None)
    if kv in (None, "auto") or not {"lockstep", "coalesce"} & set(modes):
        return
    from transformers import AutoConfig

    from batchgen.models.layers.kv_cache_dtype import resolve_kv_cache_dtype
    from batchgen.models.model_config import ModelConfig

    path = args.model or bench_model_path(args.arch)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    try:  # the bench's dtype is never auto (float32 by default)
        resolve_kv_cache_dtype(kv, getattr(torch, args.dtype), cfg.mla is not None)
    except ValueError as err:
        key = getattr(args, "from_config_file", {}).get("kv_cache_dtype")
        _usage_error(f"{key} in {args.config}: {err}" if key else f"--kv-cache-dtype: {err}")


def run_from_args(args) -> int:
    from batchgen.bench.args import resolve_settings
    from batchgen.cluster_config import ClusterConfigError

    try:
        resolve_settings(args)
    except ClusterConfigError as err:
        _usage_error(str(err))
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad:
        _usage_error(f"--modes: unknown {bad}; allowed {list(MODES)}")
    workloads = tuple(args.workloads.split(",")) if args.workloads else None
    if args.rollouts_requests is not None and args.rollouts_requests < 1:
        _usage_error(f"--rollouts-requests: must be >= 1, got {args.rollouts_requests}")
    _check_kv_cache_dtype(args, modes)
    if getattr(args, "data_parallel_size", 1) > 1:
        from batchgen.bench.distributed import (
            PARALLEL_FLAGS,
            format_distributed,
            run_distributed,
        )
        from batchgen.config import ParallelConfig

        parallel = {k: getattr(args, k) for k in PARALLEL_FLAGS if hasattr(args, k)}
        try:
            ParallelConfig(**parallel)
        except ValueError as err:
            _usage_error(str(err))
        record = run_distributed(args, parallel)
        print(json.dumps(record) if args.json else format_distributed(record))
        return 0
    record = run(
        quick=args.quick,
        dtype=args.dtype,
        device=args.device,
        modes=modes,
        workloads=workloads,
        overrides=engine_overrides(args),
        model=args.model,
        profile=args.profile,
        arch=args.arch,
        rollouts_requests=args.rollouts_requests,
        progress=not args.no_progress,
    )
    print(json.dumps(record) if args.json else format_table(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
