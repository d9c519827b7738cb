"""vLLM's side of `benchmarks/peers/run.py`; runs in the vLLM venv (`setup.sh`), not BatchGen's.

    .venv-vllm/bin/python vllm_worker.py JOB.json RESULT.json

JOB.json (written by run.py): ``model``, ``dtype``, ``kv_cache_dtype`` (optional; "auto" or
absent: vLLM's default), ``max_model_len``, ``max_num_seqs`` (None: vLLM's default), ``workload`` (``{"kind": "requests", "requests": [[prompt ids, output_len],
...]}`` or ``{"kind": "tree", "tree": TreeSearch fields}``) and ``profile_dir`` (optional: vLLM's
torch profiler traces the timed run's steps into it) and ``workloads_py`` (the path of
`batchgen/bench/workloads.py`, loaded by file so that a tree runs through the very same
`TreeSearch.run` as BatchGen's, without importing the batchgen package and its dependencies).

RESULT.json: ``seconds`` (the timed ``generate`` calls, after a warm-up), ``outputs`` (token ids
per request, in order), ``settings`` (what vLLM ran with), ``prefix_cache`` (vLLM's
``vllm:prefix_cache_queries`` / ``_hits`` counters over the timed run as ``queries`` / ``hits``,
where it reports them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time


def _load_workloads(path: str):
    spec = importlib.util.spec_from_file_location("peer_workloads", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_workloads"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _prefix_counters(llm) -> dict[str, float]:
    """vLLM's prefix-cache counters, summed over engines; empty where it does not report them."""
    out: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # older or stats-less builds: the figure is optional
        return out
    for m in metrics:
        if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            key = m.name.rsplit("_", 1)[1]  # "queries" / "hits", as BatchGen's
            out[key] = out.get(key, 0.0) + float(getattr(m, "value", 0.0))
    return out


def main() -> None:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams

    engine_args = dict(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        skip_tokenizer_init=True,  # token ids in and out: no tokenizer differences
        seed=0,
        enable_prefix_caching=True,  # V1's default, stated
        disable_log_stats=False,  # for the prefix-cache counters
    )
    if job.get("kv_cache_dtype", "auto") != "auto":
        engine_args["kv_cache_dtype"] = job["kv_cache_dtype"]
    if job["max_num_seqs"] is not None:
        engine_args["max_num_seqs"] = job["max_num_seqs"]
    profile_dir = job.get("profile_dir")
    if profile_dir:  # vLLM's worker traces its steps (`trace_summary.py` reads the trace)
        engine_args["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": profile_dir,
            "torch_profiler_with_stack": False,
            "ignore_frontend": True,
        }
    llm = LLM(**engine_args)

    def generate(requests: list[tuple[list[int], int]]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
            for _, n in requests
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids, _ in requests]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    generate([([1, 5, 6, 7], 4)] * 4)  # warm-up, untimed
    before = _prefix_counters(llm)
    spec = job["workload"]
    if profile_dir:
        llm.start_profile()
    t0 = time.perf_counter()
    if spec["kind"] == "tree":
        wl = _load_workloads(job["workloads_py"])
        tree = wl.TreeSearch(**spec["tree"])
        nodes = tree.run(lambda reqs: generate([(r.prompt_token_ids, r.output_len) for r in reqs]))
        outputs = [out for _, out in nodes]
    else:
        outputs = generate([(ids, n) for ids, n in spec["requests"]])
    seconds = time.perf_counter() - t0
    if profile_dir:
        llm.stop_profile()
    after = _prefix_counters(llm)
    sched = llm.llm_engine.vllm_config.scheduler_config
    settings = {
        "vllm_version": vllm.__version__,
        **{k: v for k, v in engine_args.items() if k != "model"},
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))},
    }
    result = {
        "seconds": seconds,
        "outputs": outputs,
        "settings": settings,
        "prefix_cache": {k: after[k] - before.get(k, 0.0) for k in after},
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
