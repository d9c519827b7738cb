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

import gc
import json
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from batchgen.bench.args import MODES, add_arguments  # noqa: F401  (re-exported for the CLI)
from batchgen.bench.flops import (
    active_params_per_token,
    attention_flops,
    measure_peak_gflops,
    sequence_flops,
)
from batchgen.bench.workloads import (
    TreeSearch,
    Workload,
    make_shared_docs,
    make_tree_search,
    make_workloads,
)

logger = logging.getLogger(__name__)

# DESIGN.md's benchmark model: Mixtral architecture, 64 experts, top-8, hidden 512, 4 layers.
BENCH_MODEL = dict(
    num_local_experts=64,
    num_experts_per_tok=8,
    hidden_size=512,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
)
BENCH_MODEL_NAME = "bench-mixtral-e64-top8-h512-l4-v1"
# The DeepSeek-V3 family at the same scale: 64 routed experts (8 groups, top-4 groups), top-8,
# one shared expert, hidden 512, 4 layers of which the first is dense, MLA with a latent of 128
# (+32 rope dims) instead of 8 x 2 x 64 KV values per token and layer.
BENCH_MODEL_DEEPSEEK_V3 = dict(
    n_routed_experts=64,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    hidden_size=512,
    moe_intermediate_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=128,
    q_lora_rank=192,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    vocab_size=512,
)
BENCH_MODELS = {
    "mixtral": (BENCH_MODEL_NAME, BENCH_MODEL),
    "deepseek_v3": ("bench-deepseek-v3-e64-top8-h512-l4-v1", BENCH_MODEL_DEEPSEEK_V3),
}
MAX_NUM_BATCHED_TOKENS = 512
KV_CACHE_GB = 8.0  # the KV budget of both BatchGen modes (4,096 rollouts need about 7.2 GB)
QUICK_KV_CACHE_GB = 1.0
# coalesce: the sequences that may run at once and the tokens of one step over all attention
# micro-batches (32 of 512 tokens). lockstep runs at most MAX_NUM_BATCHED_TOKENS per step.
MAX_ACTIVE_COROUTINES = 4096
MAX_STEP_TOKENS = 32 * MAX_NUM_BATCHED_TOKENS


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


def bench_model_path(arch: str = "mixtral") -> str:
    """The benchmark checkpoint of ``arch`` (a key of `BENCH_MODELS`), built offline on first
    use into BatchGen's cache dir. Raises ValueError for another ``arch``."""
    from batchgen.models.default_model import cached_model

    if arch not in BENCH_MODELS:
        raise ValueError(f"bench model arch must be one of {sorted(BENCH_MODELS)}, got {arch!r}")
    name, config = BENCH_MODELS[arch]
    return cached_model(name, arch, seed=0, **config)


def _workload_flops(cfg, workload: Workload | TreeSearch) -> int:
    return sum(sequence_flops(cfg, p, o, n) for p, o, n in workload.shapes())


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


PROFILE_TOP_OPS = 12
PROFILE_EVERY_STEPS = 10  # profile one engine step in this many (tracing every op is slow)


class _SampledProfile:
    """torch.profiler over one engine step in `PROFILE_EVERY_STEPS`, operator self times
    summed over the profiled steps (a whole-run trace takes minutes to aggregate)."""

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        # Each profiled step is its own cycle, collected by `_collect`: torch's warning that
        # events do not accumulate across cycles does not apply.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        self.cuda = device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.totals: dict[str, list[float]] = {}  # name -> [self microseconds, calls]
        self.prof = profile(
            activities=acts,
            schedule=schedule(wait=PROFILE_EVERY_STEPS - 2, warmup=1, active=1),
            on_trace_ready=self._collect,
        )

    def _collect(self, prof) -> None:
        for e in prof.key_averages():
            t = self.totals.setdefault(e.key, [0.0, 0])
            t[0] += e.self_device_time_total if self.cuda else e.self_cpu_time_total
            t[1] += e.count

    def top_ops(self) -> list[dict]:
        """``[{"name", "self_s", "share", "calls"}]``: the operators with the most self time
        over the profiled steps, share of all operators' self time."""
        total = sum(t[0] for t in self.totals.values()) or 1.0
        top = sorted(self.totals.items(), key=lambda kv: kv[1][0], reverse=True)
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
    threshold: int,
    profile: bool = False,
    kv_cache_gb: float = KV_CACHE_GB,
    progress: bool = False,
    enable_prefix_caching: bool = True,
) -> tuple[ModeResult, list[list[int]]]:
    from batchgen import LLM, SamplingParams

    llm = LLM(
        path,
        enable_prefix_caching=enable_prefix_caching,
        dtype=dtype,
        device=device,
        scheduler_policy=policy,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        kv_cache_memory_gb=kv_cache_gb,
        expert_coalesce_threshold=threshold,
        max_step_tokens=MAX_STEP_TOKENS,
        max_model_len=4096,
        # coalesce: MAX_ACTIVE_COROUTINES. lockstep may run as many sequences as its token
        # budget can decode in one step (vLLM's default of 256 would leave half of each decode
        # step empty here).
        max_num_seqs=MAX_ACTIVE_COROUTINES if policy == "coalesce" else MAX_NUM_BATCHED_TOKENS,
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
        out = step()
        if sampled is not None:
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
        },
    )
    if sampled is not None:
        result.extra["profile_top_ops"] = sampled.top_ops()
        result.extra["profiled_steps"] = f"1 in {PROFILE_EVERY_STEPS}"
    if m["decode_only_seconds"] > 0:
        per_tok = 2 * active_params_per_token(cfg) + attention_flops(
            cfg, int(m["decode_only_mean_context"])
        )
        result.extra["decode_flops_per_s"] = (
            per_tok * m["decode_only_tokens"] / m["decode_only_seconds"]
        )
    del llm
    gc.collect()
    return result, greedy


def _hf_model(path: str, dtype: torch.dtype, device: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def run_hf_generate(
    model, workload: Workload, batch_size: int = 64, progress: bool = False
) -> ModeResult:
    device = next(model.parameters()).device
    rows = [
        (r.prompt_token_ids, r.output_len, r.n > 1) for r in workload.requests for _ in range(r.n)
    ]
    bar = _progress(workload, "hf_generate", progress)
    t0 = time.perf_counter()
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        width = max(len(p) for p, _, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _, _) in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        longest = max(o for _, o, _ in batch)
        with torch.no_grad():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=batch[0][2],
                pad_token_id=0,
                eos_token_id=None,
            )
        bar.update(sum(o for _, o, _ in batch))
    seconds = time.perf_counter() - t0
    bar.close()
    useful = workload.useful_tokens
    return ModeResult(tokens_per_s=useful / seconds, seconds=seconds, useful_tokens=useful, mfu=0.0)


def run_hf_generate_batch(model, workload: Workload, progress: bool = False) -> ModeResult:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    buckets: dict[int, list[list[int]]] = {}
    for r in workload.requests:
        buckets.setdefault(_bucket(r), []).extend([r.prompt_token_ids] * r.n)
    # No block sharing: with n = 16 copies of a prompt, prefix sharing made generate_batch
    # stall for minutes on CPU here.
    cb = ContinuousBatchingConfig(
        max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
        num_blocks=512,
        page_size=64,
        allow_block_sharing=False,
    )
    bar = _progress(workload, "hf_generate_batch", progress)
    t0 = time.perf_counter()
    for max_new, prompts in sorted(buckets.items()):
        gen = GenerationConfig(
            max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        outs = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False
        )
        # generate_batch reports a failed request in its output instead of raising (e.g. the
        # DeepSeek-V3 MLA cache is not supported by its paged cache in transformers 5.x).
        for out in outs.values():
            if len(out.generated_tokens) < max_new:
                raise RuntimeError(
                    f"transformers generate_batch returned {len(out.generated_tokens)} of "
                    f"{max_new} tokens for a request: {getattr(out, 'error', None)}"
                )
        # Useful tokens of the bucket's requests (their own output lengths, not max_new).
        bar.update(sum(r.output_len * r.n for r in workload.requests if _bucket(r) == max_new))
    seconds = time.perf_counter() - t0
    bar.close()
    useful = workload.useful_tokens
    return ModeResult(
        tokens_per_s=useful / seconds,
        seconds=seconds,
        useful_tokens=useful,
        mfu=0.0,
        extra={"buckets": sorted(buckets)},
    )


def _bucket(request) -> int:
    """``generate_batch``'s ``max_new_tokens`` bucket of a request: its output length rounded
    up to a power of two."""
    return 1 << math.ceil(math.log2(request.output_len))


# Sequences of each workload the `transformers` baselines run on (full, quick).
HF_SEQUENCES = {"hf_generate": (128, 64), "hf_generate_batch": (64, 16)}


def _hf_sample(workload: Workload, quick: bool, mode: str) -> Workload:
    """The `transformers` baselines run on the first requests covering `HF_SEQUENCES`
    sequences (128 for ``generate``: two static batches of 64, one with ``--quick``; 64 for
    ``generate_batch``, the slowest mode, 16 with ``--quick``) and report their rate: tokens/s
    on a sample of the same distribution is representative, and the whole workload would take
    hours (4,096 rollouts at ~67 tokens/s)."""
    limit = HF_SEQUENCES[mode][1 if quick else 0]
    taken, seqs = [], 0
    for r in workload.requests:
        if seqs >= limit:
            break
        taken.append(r)
        seqs += r.n
    return Workload(workload.name, taken)


def run(
    quick: bool = False,
    dtype: str = "float32",
    device: str = "cpu",
    modes: tuple[str, ...] = MODES,
    workloads: tuple[str, ...] | None = None,
    threshold: int = 256,
    model: str | None = None,
    profile: bool = False,
    arch: str = "mixtral",
    rollouts_requests: int | None = None,
    progress: bool = False,
) -> dict:
    """Run the benchmark; returns the ``--json`` record (see `format_table`). ``progress``:
    a tqdm bar per mode on stderr, over the useful tokens."""
    from batchgen.engine.llm_engine import resolve_device
    from batchgen.models.loader import _DTYPES

    dev = resolve_device(device)
    torch_dtype = _DTYPES[dtype]
    path = model or bench_model_path(arch)
    peak = measure_peak_gflops(torch_dtype, dev)
    record: dict = {
        "peak_gflops": peak,
        "dtype": dtype,
        "device": str(dev),
        "model": path,
        "quick": quick,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "expert_coalesce_threshold": threshold,
        "max_active_coroutines": MAX_ACTIVE_COROUTINES,
        "max_step_tokens": MAX_STEP_TOKENS,
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
                    threshold,
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
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            kv_cache_memory_gb=kv_gb,
            expert_coalesce_threshold=threshold,
            max_step_tokens=MAX_STEP_TOKENS,
            max_model_len=4096,
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
    return _finish_record(record, torch_dtype, dev, peak)


def _run_mode(
    mode,
    path,
    workload,
    cfg,
    flops,
    quick,
    dtype,
    device,
    threshold,
    profile,
    kv_gb,
    hf_model,
    progress=False,
) -> dict:
    """One mode on one workload: the `ModeResult` as a dict (MFU filled in later)."""
    if mode in ("lockstep", "coalesce"):
        res, greedy = run_batchgen(
            path, workload, mode, dtype, device, threshold, profile, kv_gb, progress
        )
        if workload.name in ("shared-docs", "tree-search"):  # again without the prefix cache
            off, greedy_off = run_batchgen(
                path, workload, mode, dtype, device, threshold, False, kv_gb, progress, False
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
            else run_hf_generate_batch(hf, sample, progress=progress)
        )
        res.extra["sampled_requests"] = len(sample.requests)
        mode_flops = _workload_flops(cfg, sample)
    res.extra["useful_flops"] = mode_flops
    return asdict(res)


def _finish_record(record: dict, torch_dtype: torch.dtype, dev: torch.device, peak: float) -> dict:
    """Fill in every successful mode's MFU and decode MFU against the better peak."""
    # The matmul peak moves with the machine's load: measure it again at the end and divide by
    # the better of the two, so a slow first measurement cannot inflate every MFU.
    end_peak = measure_peak_gflops(torch_dtype, dev)
    record["peak_gflops_measurements"] = [peak, end_peak]
    peak = record["peak_gflops"] = max(peak, end_peak)
    for w in record["workloads"].values():
        for mode in MODES:
            if mode not in w or "error" in w[mode]:
                continue
            r = w[mode]
            r["mfu"] = r["extra"]["useful_flops"] / r["seconds"] / (peak * 1e9)
            if "decode_flops_per_s" in r["extra"]:
                r["decode_mfu"] = r["extra"].pop("decode_flops_per_s") / (peak * 1e9)
    return record


def format_table(record: dict) -> str:
    """Human-readable table of a `run` record."""
    lines = [
        f"peak {record['peak_gflops']:.1f} GFLOP/s ({record['dtype']}, {record['device']},"
        f" {record['torch_threads']} threads); max_num_batched_tokens "
        f"{record['max_num_batched_tokens']}, expert_coalesce_threshold "
        f"{record['expert_coalesce_threshold']}",
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
            r_shares = w[mode]["extra"].get("stage_time_share", {})
            stages = ", ".join(f"{k} {v:.2f}" for k, v in r_shares.items() if v >= 0.005)
            lines.append(f"\nprofile {name}/{mode} (stage time shares: {stages})")
            lines.append(f"  {'operator':<52} {'self s':>8} {'share':>6} {'calls':>8}")
            for op in top:
                lines.append(
                    f"  {op['name'][:52]:<52} {op['self_s']:>8.2f} {op['share']:>6.3f} "
                    f"{op['calls']:>8}"
                )
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="batchgen bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def run_from_args(args) -> int:
    from batchgen.bench.args import resolve_settings
    from batchgen.cluster_config import ClusterConfigError

    try:
        resolve_settings(args)
    except ClusterConfigError as err:
        raise SystemExit(f"batchgen bench: error: {err}") from None
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; allowed {list(MODES)}")
    workloads = tuple(args.workloads.split(",")) if args.workloads else None
    if args.rollouts_requests is not None and args.rollouts_requests < 1:
        raise SystemExit(f"--rollouts-requests: must be >= 1, got {args.rollouts_requests}")
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
            raise SystemExit(f"batchgen bench: error: {err}") from None
        record = run_distributed(args, parallel)
        print(json.dumps(record) if args.json else format_distributed(record))
        return 0
    record = run(
        quick=args.quick,
        dtype=args.dtype,
        device=args.device,
        modes=modes,
        workloads=workloads,
        threshold=args.expert_coalesce_threshold,
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
