"""A/B of CUDA graphs for decode steps (`batchgen.engine.cuda_graphs`) on the bench model:
the same greedy generate with ``enforce_eager=True`` and with graphs, alternated, reporting
decode-only tokens/s of each, their ratio, the share of steps replayed, and whether the tokens
agree. Prints one JSON line ``DECODE_GRAPHS {...}`` (the device run keeps it in log.txt).

    python benchmarks/decode_graphs.py --device cuda --dtype bfloat16      # the device run
    python benchmarks/decode_graphs.py --device cpu --dtype float32 --dry-run --requests 4

``--dry-run`` (CPU): graphs are never built on CPU, so the "graphs" engine captures with
`RecordingGraphBackend` (re-runs the captured forward): it checks the plumbing end to end, its
timing means nothing. Decode tokens/s is ``decode_only_tokens / decode_only_seconds`` of the
engine metrics (steps made only of decode tokens), over each run after a warm-up generate.
In bf16 the two modes may differ in the last bits (the padded batch changes GEMM shapes), so
token agreement is reported, not asserted.
"""

from __future__ import annotations

import argparse
import json

from batchgen import LLM, SamplingParams
from batchgen.engine import cuda_graphs


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    llm.llm_engine.reset_metrics()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.get_metrics()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None, help="default: the embedded bench model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs, alternated")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    if args.dry_run:
        real = cuda_graphs.graph_backend_for
        cuda_graphs.graph_backend_for = lambda device, eager: (
            None if eager else cuda_graphs.RecordingGraphBackend()
        )
    kwargs = dict(model=args.model, device=args.device, dtype=args.dtype,
                  max_num_seqs=args.requests)  # fmt: skip
    engines = {mode: LLM(enforce_eager=mode == "eager", **kwargs) for mode in ("eager", "graphs")}
    if args.dry_run:
        cuda_graphs.graph_backend_for = real
    prompts = [[(7 * i + j) % 200 + 1 for j in range(8 + i % 5)] for i in range(args.requests)]
    for llm in engines.values():  # warm-up (the allocator, Triton compiles of eager shapes)
        run(llm, prompts[:2], 4)
    rates: dict[str, list[float]] = {m: [] for m in engines}
    tokens, share = {}, 0.0
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            tokens[mode], m = run(llm, prompts, args.max_tokens)
            rates[mode].append(m["decode_only_tokens"] / max(m["decode_only_seconds"], 1e-9))
            if mode == "graphs":
                share = m["cuda_graph_step_share"]
    best = {m: max(r) for m, r in rates.items()}
    record = {
        "device": args.device, "dtype": args.dtype, "requests": args.requests,
        "max_tokens": args.max_tokens, "dry_run": args.dry_run,
        "decode_tokens_per_s": best, "graphs_over_eager": best["graphs"] / best["eager"],
        "cuda_graph_step_share": share, "tokens_equal": tokens["eager"] == tokens["graphs"],
        "graph_runner_built": engines["graphs"].llm_engine.executor.graph_runner is not None,
    }  # fmt: skip
    print("DECODE_GRAPHS " + json.dumps(record))


if __name__ == "__main__":
    main()
