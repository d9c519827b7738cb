"""BatchGen's benchmark modes (``lockstep`` / ``coalesce``): one `LLM` per mode on a workload
(`run_batchgen`), one `generate` per tree level for ``tree-search`` (`_generate`), with an
optional operator profile sampled over the engine's steps (`_SampledProfile`)."""

from __future__ import annotations

import gc
import time
import warnings

import torch

from batchgen.bench.bench_model import KV_CACHE_GB, override_kwargs
from batchgen.bench.flops import active_params_per_token, attention_flops
from batchgen.bench.results import ModeResult, _progress
from batchgen.bench.workloads import TreeSearch, Workload


PROFILE_TOP_OPS = 12
PROFILE_EVERY_STEPS = 10  # profile one engine step in this many (tracing every op is slow)


def engine_settings(config) -> dict:
    """The scheduling settings an engine runs under (`batchgen.config.EngineConfig`, defaults
    resolved): ``max_num_batched_tokens``, ``max_num_seqs``, step tokens, threshold, block size,
    KV cache dtype, KV budget (GiB) and ``max_model_len``."""
    return {
        "scheduler_policy": config.scheduler_policy,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_running_seqs,
        "max_step_tokens": config.step_token_budget,
        "expert_coalesce_threshold": config.expert_coalesce_threshold,
        "block_size": config.block_size,
        "kv_cache_dtype": config.kv_cache_dtype,
        "kv_cache_memory_gb": config.kv_cache_memory_gb,
        "max_model_len": config.max_model_len,
    }


class _SampledProfile:
    """torch.profiler over one engine step in `PROFILE_EVERY_STEPS`, operator self times
    summed over the profiled steps (a whole-run trace takes minutes to aggregate), and apart
    over the profiled steps that were decode-only (``step_decode_only``, set by the caller
    before each ``prof.step()``)."""

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        # Each profiled step is its own cycle, collected by `_collect`: torch's warning that
        # events do not accumulate across cycles does not apply.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        self.cuda = device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.totals: dict[str, list[float]] = {}  # name -> [self microseconds, calls]
        self.decode_totals: dict[str, list[float]] = {}  # the same, decode-only steps
        self.step_decode_only = False
        self.traced_steps = self.traced_decode_steps = 0
        self.prof = profile(
            activities=acts,
            schedule=schedule(wait=PROFILE_EVERY_STEPS - 2, warmup=1, active=1),
            on_trace_ready=self._collect,
        )

    def _collect(self, prof) -> None:
        targets = [self.totals] + ([self.decode_totals] if self.step_decode_only else [])
        self.traced_steps += 1
        self.traced_decode_steps += self.step_decode_only
        for e in prof.key_averages():
            us = e.self_device_time_total if self.cuda else e.self_cpu_time_total
            for totals in targets:
                t = totals.setdefault(e.key, [0.0, 0])
                t[0] += us
                t[1] += e.count

    def top_ops(self, decode_only: bool = False) -> list[dict]:
        """``[{"name", "self_s", "share", "calls"}]``: the operators with the most self time
        over the profiled steps (``decode_only``: the decode-only ones), share of all
        operators' self time in those steps."""
        totals = self.decode_totals if decode_only else self.totals
        total = sum(t[0] for t in totals.values()) or 1.0
        top = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)
        return [
            {"name": name, "self_s": us / 1e6, "share": us / total, "calls": int(calls)}
            for name, (us, calls) in top[:PROFILE_TOP_OPS]
        ]


def _sampling_params(requests) -> list:
    """Greedy for ``n`` = 1, seeded sampling (seed = the request's index) for ``n`` > 1."""
    from batchgen import SamplingParams

    return [
        SamplingParams(
            n=r.n,
            max_tokens=r.output_len,
            ignore_eos=True,
            temperature=0.0 if r.n == 1 else 1.0,
            seed=None if r.n == 1 else i,
        )
        for i, r in enumerate(requests)
    ]


def _generate(llm, workload: Workload | TreeSearch) -> tuple[int, list[list[int]]]:
    """Run ``workload`` on ``llm``: one ``generate`` call, or one per level of a `TreeSearch`.
    Returns the tokens generated and the token ids of every ``n`` = 1 request, in order."""

    def generate(requests):
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        return llm.generate(prompts, _sampling_params(requests), use_tqdm=False)

    if isinstance(workload, TreeSearch):
        nodes = workload.run(lambda reqs: [out.outputs[0].token_ids for out in generate(reqs)])
        return sum(len(tokens) for _, tokens in nodes), [tokens for _, tokens in nodes]
    outs = generate(workload.requests)
    produced = sum(len(o.token_ids) for out in outs for o in out.outputs)
    return produced, [o.outputs[0].token_ids for o in outs if o.outputs and len(o.outputs) == 1]


def run_batchgen(
    path: str,
    workload: Workload | TreeSearch,
    policy: str,
    dtype: str,
    device: str,
    overrides: dict | None,
    profile: bool = False,
    kv_cache_gb: float = KV_CACHE_GB,
    progress: bool = False,
    enable_prefix_caching: bool = True,
) -> tuple[ModeResult, list[list[int]]]:
    """One BatchGen mode on ``workload``: an `LLM` with the engine's defaults of ``policy``
    (`batchgen.config.EngineConfig`: step tokens, running sequences, coalescing threshold),
    ``kv_cache_gb`` GiB of KV cache, ``max_model_len`` 4,096 and the settings of ``overrides``
    (`override_kwargs`: the bench's ``--expert-coalesce-threshold``, ``--kv-cache-dtype``). Returns the mode's figures (the settings it
    ran under in ``extra["engine_settings"]``) and the greedy outputs' token ids.

    Raises:
        RuntimeError: the engine produced another number of tokens than the workload asks.
    """
    from batchgen import LLM, SamplingParams

    llm = LLM(
        path,
        enable_prefix_caching=enable_prefix_caching,
        dtype=dtype,
        device=device,
        scheduler_policy=policy,
        kv_cache_memory_gb=kv_cache_gb,
        max_model_len=4096,
        **override_kwargs(overrides),
    )
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([[1, 5, 6, 7]] * 4, warm, use_tqdm=False)
    llm.llm_engine.reset_metrics()
    engine = llm.llm_engine
    step = engine.step
    sampled = _SampledProfile(engine.device) if profile else None
    bar = _progress(workload, policy, progress)
    # Every generated token is useful here (ignore_eos, exact max_tokens).
    counted = [engine.stats.num_generated_tokens]

    def bench_step():
        before = engine.metrics.decode_only_steps
        out = step()
        if sampled is not None:
            sampled.step_decode_only = engine.metrics.decode_only_steps > before
            sampled.prof.step()
        bar.update(engine.stats.num_generated_tokens - counted[0])
        counted[0] = engine.stats.num_generated_tokens
        return out

    engine.step = bench_step
    if sampled is not None:
        sampled.prof.start()
    t0 = time.perf_counter()
    try:
        produced, greedy = _generate(llm, workload)
    finally:
        seconds = time.perf_counter() - t0
        bar.close()
        del engine.step
    if sampled is not None:
        sampled.prof.stop()
    if produced != workload.useful_tokens:
        raise RuntimeError(
            f"{policy}: produced {produced} tokens, expected {workload.useful_tokens}"
        )
    m = llm.get_metrics()
    cfg = llm.llm_engine.model_config
    result = ModeResult(
        tokens_per_s=produced / seconds,
        seconds=seconds,
        useful_tokens=produced,
        mfu=0.0,
        tile_density=m["tile_density"],
        mean_rows_per_expert_gemm=m["mean_rows_per_expert_gemm"],
        num_expert_gemms=m["num_expert_gemms"],
        extra={
            "stage_time_share": m["stage_time_share"],
            "peak_memory_bytes": m["peak_memory_bytes"],
            "num_preemptions": m["num_preemptions"],
            "decode_only_tokens": m["decode_only_tokens"],
            "decode_only_seconds": m["decode_only_seconds"],
            "decode_only_mean_context": m["decode_only_mean_context"],
            "decode_only_stage_time_share": m["decode_only_stage_time_share"],
            "shared_prefix_tokens": m["shared_prefix_tokens"],
            "prefill_tokens": m["prefill_tokens"],
            "prefix_cache_hits": m["prefix_cache_hits"],
            "prefix_cache_hit_rate": m["prefix_cache_hit_rate"],
            "cuda_graph_step_share": m["cuda_graph_step_share"],
            "engine_settings": engine_settings(llm.llm_engine.config),
        },
    )
    if sampled is not None:
        result.extra["profile_top_ops"] = sampled.top_ops()
        result.extra["profile_top_ops_decode_only"] = sampled.top_ops(decode_only=True)
        result.extra["profiled_steps"] = f"1 in {PROFILE_EVERY_STEPS}"
        result.extra["profiled_step_counts"] = {
            "all": sampled.traced_steps,
            "decode_only": sampled.traced_decode_steps,
        }
    if m["decode_only_seconds"] > 0:
        per_tok = 2 * active_params_per_token(cfg) + attention_flops(
            cfg, int(m["decode_only_mean_context"])
        )
        result.extra["decode_flops_per_s"] = (
            per_tok * m["decode_only_tokens"] / m["decode_only_seconds"]
        )
        # `batchgen.bench.roofline.decode_roofline`'s inputs; the runner adds the peaks.
        result.extra["decode_only_steps"] = m["decode_only_steps"]
        result.extra["decode_only_step_tokens"] = m["decode_only_step_tokens"]
        result.extra["weight_itemsize"] = engine.dtype.itemsize
        result.extra["kv_itemsize"] = engine.kv_cache_dtype.itemsize
    del llm
    gc.collect()
    return result, greedy
