"""BatchGen against vLLM's CPU backend on the same checkpoint and workload, one after the other.

    bash benchmarks/peers/setup.sh          # once: vLLM's CPU build in benchmarks/peers/.venv-vllm
    PYTHONPATH=$PWD .venv/bin/python benchmarks/peers/run.py --workload rollouts --requests 64

The checkpoint is `batchgen bench`'s random-weight Mixtral (``--model-config bench``) or one of
issue 19's two variants, built offline on first use; the workload comes from
`batchgen.bench.workloads` with the bench's seed (``rollouts``: the first ``--requests`` of its
generator; ``shared-docs`` and ``tree-search`` as ``batchgen bench --workloads`` makes them,
tree-search one ``generate`` per level through the same `TreeSearch.run` in both engines).
Every request is greedy with ``ignore_eos`` and exactly its output length, so both engines do
the same work. vLLM runs first, in its own venv as a subprocess (`vllm_worker.py`: offline
``LLM.generate``, token ids in and out, prefix caching on), then BatchGen in this process with
its defaults (``LLM(path, dtype, kv_cache_memory_gb, max_model_len)``; ``detokenize=False``,
token ids out as vLLM's). Each engine gets the
same KV budget and an untimed warm-up; engine start-up is not timed. Prints both useful
tokens/s, their ratio (BatchGen over vLLM), how many sequences and tokens agree, and the
prefix-cache hit rates; ``--json`` prints the whole record instead, ``--out FILE`` writes it.
``--profile DIR`` traces both timed runs with torch.profiler (vLLM's own worker profiler; BatchGen
in this process, its steps annotated as vLLM's) and prints where each engine's time goes
(`trace_summary.py`: time per operator class, outside operators, steps, rows per decode step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# Issue 19's two models besides the bench's own (64 experts, expert intermediate 256).
MODEL_VARIANTS = {
    "e64-i512": dict(intermediate_size=512),
    "e256-i256": dict(num_local_experts=256),
}
MAX_MODEL_LEN = 4096


def model_path(args) -> str:
    """The checkpoint: ``--model``, else the bench's (``bench``), else a named variant of it or a
    JSON object of HF config overrides on it, built once into BatchGen's cache dir."""
    from batchgen.bench.runner import BENCH_MODEL, BENCH_MODEL_NAME, bench_model_path
    from batchgen.models.default_model import cached_model

    if args.model:
        return args.model
    if args.model_config == "bench":
        return bench_model_path("mixtral")
    if args.model_config in MODEL_VARIANTS:
        name, overrides = args.model_config, MODEL_VARIANTS[args.model_config]
    else:
        try:
            overrides = json.loads(args.model_config)
        except json.JSONDecodeError:
            raise SystemExit(
                f"--model-config: expected bench, {', '.join(MODEL_VARIANTS)} or a JSON object, "
                f"got {args.model_config!r}"
            ) from None
        if not isinstance(overrides, dict):
            raise SystemExit(f"--model-config: a JSON object, got {args.model_config!r}")
        name = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    config = {**BENCH_MODEL, **overrides}
    return cached_model(f"{BENCH_MODEL_NAME}-peers-{name}", "mixtral", seed=0, **config)


def make_workload(args, vocab_size: int):
    """The `Workload` or `TreeSearch` of ``--workload``, with the bench's generator and seed."""
    from batchgen.bench.workloads import make_shared_docs, make_tree_search, make_workloads

    if args.workload == "rollouts":
        return make_workloads(vocab_size, args.quick, rollouts_requests=args.requests)[0]
    if args.workload == "shared-docs":
        return make_shared_docs(vocab_size, args.quick)
    return make_tree_search(vocab_size, args.quick)


def _job(workload, path: str, args) -> dict:
    from batchgen.bench.workloads import TreeSearch

    if isinstance(workload, TreeSearch):
        spec = {"kind": "tree", "tree": dataclasses.asdict(workload)}
    else:
        assert all(r.n == 1 for r in workload.requests)
        spec = {
            "kind": "requests",
            "requests": [[r.prompt_token_ids, r.output_len] for r in workload.requests],
        }
    return {
        "model": path,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": args.vllm_max_num_seqs,
        "workload": spec,
        "workloads_py": str(REPO / "batchgen" / "bench" / "workloads.py"),
        "profile_dir": str(Path(args.profile).resolve() / "vllm") if args.profile else None,
    }


def run_vllm(workload, path: str, args) -> dict:
    """vLLM's run in its venv (`vllm_worker.py`); returns its result dict.

    Raises:
        SystemExit: the vLLM venv is missing, or the worker failed (its log's tail is shown).
    """
    python = Path(args.vllm_python)
    if not python.is_file():
        raise SystemExit(f"--vllm-python: {python} not found; run benchmarks/peers/setup.sh")
    env = {k: v for k, v in args.vllm_environ.items() if k != "PYTHONPATH"}
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=args.vllm_threads_bind,
        VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gb),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        job, result, log = (Path(tmp) / n for n in ("job.json", "result.json", "vllm.log"))
        job.write_text(json.dumps(_job(workload, path, args)))
        cmd = [str(python), str(HERE / "vllm_worker.py"), str(job), str(result)]
        with open(log, "w") as f:
            proc = subprocess.run(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout_s
            )
        if proc.returncode != 0:
            tail = log.read_text(errors="replace")[-4000:]
            raise SystemExit(f"vLLM worker failed (exit {proc.returncode}):\n{tail}")
        return json.loads(result.read_text())


def run_batchgen(workload, path: str, args) -> dict:
    """BatchGen with its defaults (dtype, KV budget and max_model_len as vLLM's) in this process."""
    from batchgen import LLM, SamplingParams
    from batchgen.bench.workloads import TreeSearch

    llm = LLM(
        path,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_gb=float(args.kv_cache_gb),
        max_model_len=MAX_MODEL_LEN,
        seed=0,
    )

    def generate(requests) -> list[list[int]]:
        params = [
            # token ids in and out, as vLLM's worker runs (``detokenize=False``)
            SamplingParams(
                temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False
            )
            for r in requests
        ]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([[1, 5, 6, 7]] * 4, warm, use_tqdm=False)
    llm.llm_engine.reset_metrics()
    profiler = _StepProfiler(llm.llm_engine, args.profile) if args.profile else None
    t0 = time.perf_counter()
    if isinstance(workload, TreeSearch):
        outputs = [out for _, out in workload.run(generate)]
    else:
        outputs = generate(workload.requests)
    seconds = time.perf_counter() - t0
    if profiler is not None:
        profiler.stop()
    m = llm.get_metrics()
    c = llm.llm_engine.config
    return {
        "seconds": seconds,
        "outputs": outputs,
        "settings": {
            "dtype": args.dtype,
            "kv_cache_dtype": c.kv_cache_dtype,
            "openmp_env_set": args.openmp_env_set,
            "scheduler_policy": c.scheduler_policy,
            "max_num_seqs": c.max_running_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "kv_cache_memory_gb": c.kv_cache_memory_gb,
            "enable_prefix_caching": c.enable_prefix_caching,
        },
        "prefix_cache": {"queries": m["prefix_cache_queries"], "hits": m["prefix_cache_hits"]},
    }


class _StepProfiler:
    """torch.profiler over BatchGen's timed run, each engine step annotated as vLLM's worker
    annotates its steps (``execute_context_<requests>(<tokens>)_generation_<requests>(<tokens>)``)
    so that `trace_summary.py` reads both traces alike; written to ``DIR/batchgen/trace.json``."""

    def __init__(self, engine, out_dir: str) -> None:
        import torch

        self.engine, self.step = engine, engine.step
        self.path = Path(out_dir).resolve() / "batchgen" / "trace.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        scheduler = engine.schedule

        def schedule():
            sched = scheduler()
            ctx = [e.num_new_tokens for e in sched.scheduled if e.seq.num_output_tokens == 0]
            gen = len(sched.scheduled) - len(ctx)
            name = f"execute_context_{len(ctx)}({sum(ctx)})_generation_{gen}({gen})"
            self._scope = torch.profiler.record_function(name)
            self._scope.__enter__()
            return sched

        def step():
            try:
                return self.step()
            finally:
                if getattr(self, "_scope", None) is not None:
                    self._scope.__exit__(None, None, None)
                    self._scope = None

        engine.schedule, engine.step = schedule, step
        self.prof.start()

    def stop(self) -> None:
        self.prof.stop()
        del self.engine.schedule, self.engine.step
        self.prof.export_chrome_trace(str(self.path))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Sequences whose tokens are identical, and tokens equal at the same position."""
    return {
        "sequences_identical": sum(x == y for x, y in zip(a, b)),
        "sequences": len(a),
        "tokens_equal": sum(p == q for x, y in zip(a, b) for p, q in zip(x, y)),
        "tokens": sum(len(x) for x in a),
    }


def _summary(result: dict, useful: int) -> dict:
    pc = result.get("prefix_cache") or {}
    queries = pc.get("queries") or 0
    produced = sum(len(o) for o in result["outputs"])
    if produced != useful:
        raise SystemExit(f"an engine produced {produced} tokens, expected {useful}")
    return {
        "tokens_per_s": useful / result["seconds"],
        "seconds": result["seconds"],
        "prefix_cache_hit_rate": (pc.get("hits", 0) / queries) if queries else None,
        "prefix_cache": pc,
        "settings": result["settings"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--workload", default="rollouts", choices=["rollouts", "shared-docs", "tree-search"]
    )
    p.add_argument("--requests", type=int, default=64, help="rollouts requests (default 64)")
    p.add_argument("--quick", action="store_true", help="the bench's --quick workload sizes")
    p.add_argument(
        "--model-config",
        default="bench",
        help=f"bench (batchgen bench's Mixtral: 64 experts top-8, hidden 512, expert "
        f"intermediate 256, 4 layers), {', '.join(MODEL_VARIANTS)} (issue 19's variants), or a "
        "JSON object of HF config overrides on the bench's",
    )
    p.add_argument(
        "--model", default=None, help="an existing checkpoint (overrides --model-config)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-gb", type=int, default=4, help="KV budget of each engine, GiB")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="both engines' kv_cache_dtype (vLLM's CPU backend takes auto and the fp8 ones)",
    )
    p.add_argument("--vllm-python", default=str(HERE / ".venv-vllm" / "bin" / "python"))
    p.add_argument(
        "--vllm-threads-bind",
        default=f"0-{(os.cpu_count() or 1) - 1}",
        help="VLLM_CPU_OMP_THREADS_BIND (default every core: vLLM's 'auto' leaves one core to "
        "its engine-core process, much slower on 2 cores)",
    )
    p.add_argument("--vllm-max-num-seqs", type=int, default=None, help="default: vLLM's (256)")
    p.add_argument("--engines", default="vllm,batchgen", help="comma-separated, run in this order")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="vLLM worker's time limit")
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="trace each engine's timed run with torch.profiler into DIR/vllm and "
        "DIR/batchgen and print where the time goes (trace_summary.py; slows both engines)",
    )
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.add_argument("--out", default=None, help="also write the JSON record to this file")
    args = p.parse_args(argv)
    # vLLM gets the environment as the caller gave it; this process takes what `batchgen` and
    # `batchgen.LLM` set before torch loads (OpenMP's wait policy; batchgen.engine.cpu_threads).
    vllm_environ = dict(os.environ)
    from batchgen.engine.cpu_threads import set_openmp_wait_policy

    openmp = set_openmp_wait_policy()
    args.vllm_environ = vllm_environ
    args.openmp_env_set = openmp
    engines = [e for e in args.engines.split(",") if e]
    if not engines or set(engines) - {"vllm", "batchgen"}:
        raise SystemExit(f"--engines: a subset of vllm,batchgen, got {args.engines!r}")
    if args.requests < 1:
        raise SystemExit(f"--requests: must be >= 1, got {args.requests}")

    from transformers import AutoConfig

    path = model_path(args)
    workload = make_workload(args, AutoConfig.from_pretrained(path).vocab_size)
    record: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "workload": args.workload,
        "quick": args.quick,
        "requests": workload.num_requests,
        "prompt_tokens": workload.prompt_tokens,
        "useful_tokens": workload.useful_tokens,
        "model": path,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_gb": args.kv_cache_gb,
        "cpus": os.cpu_count(),
        "load_average_before": os.getloadavg()[0],
        "engines": {},
    }
    outputs = {}
    for engine in engines:
        run = run_vllm if engine == "vllm" else run_batchgen
        result = run(workload, path, args)
        outputs[engine] = result["outputs"]
        record["engines"][engine] = _summary(result, workload.useful_tokens)
    record["load_average_after"] = os.getloadavg()[0]
    if len(outputs) == 2:
        record["agreement"] = agreement(outputs["vllm"], outputs["batchgen"])
        e = record["engines"]
        record["ratio"] = e["batchgen"]["tokens_per_s"] / e["vllm"]["tokens_per_s"]
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record) if args.json else format_record(record))
    if args.profile:
        _print_profiles(Path(args.profile), engines)
    return 0


def _print_profiles(out: Path, engines: list[str]) -> None:
    """`trace_summary.py`'s reading of each engine's trace."""
    sys.path.insert(0, str(HERE))
    from trace_summary import format_summary, summarize

    for engine in engines:
        traces = sorted((out / engine).glob("*trace.json*"))
        if not traces:
            print(f"{engine}: no trace in {out / engine}")
        for trace in traces:
            print(f"{engine}: {format_summary(summarize(str(trace)))}")


def format_record(r: dict) -> str:
    lines = [
        f"{r['workload']}: {r['requests']} requests, {r['prompt_tokens']} prompt tokens, "
        f"{r['useful_tokens']} useful tokens, {r['dtype']}, "
        f"KV cache {r.get('kv_cache_dtype', 'auto')}, {r['model']} "
        f"(load average {r['load_average_before']:.1f} -> {r['load_average_after']:.1f} "
        f"on {r['cpus']} CPUs)"
    ]
    for name, e in r["engines"].items():
        hit = e["prefix_cache_hit_rate"]
        lines.append(
            f"  {name:<9} {e['tokens_per_s']:8.1f} tokens/s  {e['seconds']:7.1f} s  "
            f"prefix-cache hit rate {'-' if hit is None else f'{hit:.2f}'}  {e['settings']}"
        )
    if "ratio" in r:
        a = r["agreement"]
        lines.append(
            f"  BatchGen / vLLM: {r['ratio']:.2f}x; outputs agree: {a['sequences_identical']} of "
            f"{a['sequences']} sequences identical, {a['tokens_equal']} of {a['tokens']} tokens "
            "equal at the same position"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
