"""The cost of the batch-invariant mode: one engine with ``batch_invariant=False`` beside one
with ``batch_invariant=True``, the same workload alternating between them in one process.

    .venv/bin/python benchmarks/batch_invariance.py [--prompts 64] [--prompt-len 128]
        [--max-tokens 32] [--rounds 2] [--model PATH | --bench-model]
    .venv/bin/python benchmarks/batch_invariance.py --gemm   # the GEMM alone against MKL

Default: the embedded model (Mixtral architecture, random weights, hidden 128, 8 experts);
``--bench-model``: `batchgen bench`'s model (hidden 512, 64 experts, top-8); float32 on CPU. Prints,
per mode, the median and the minimum over rounds of the wall time of one ``generate`` call and
its generated tokens per second (prefill included), and the ratios (on a machine shared with
other jobs the minimum is the steadier figure). ``--gemm`` instead times
`invariant_linear` beside ``F.linear`` (MKL) on two weight shapes at 8 to 2,048 rows, with
one thread and with torch's thread count (medians of 7 calls, GFLOP/s).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from batchgen import LLM, SamplingParams
from batchgen.bench.runner import bench_model_path
from batchgen.kernels.invariant_linear import invariant_linear, pack_linear_weight


def gemm_bench() -> None:
    """`invariant_linear` against ``F.linear`` on the same weights, one process."""
    threads = torch.get_num_threads()

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    for num_threads in sorted({1, threads}):
        torch.set_num_threads(num_threads)
        for k, n in ((512, 1536), (1024, 4096)):
            w = torch.randn(n, k)
            packed = pack_linear_weight(w)
            for m in (8, 64, 512, 2048):
                x = torch.randn(m, k)
                mkl = median_ms(lambda: F.linear(x, w))
                inv = median_ms(lambda: invariant_linear(x, w, packed=packed))
                gf = 2 * m * k * n / 1e6
                print(
                    f"threads {num_threads} K {k} N {n} M {m:5d}: MKL {mkl:8.2f} ms "
                    f"({gf / mkl:4.0f} GFLOP/s), invariant {inv:8.2f} ms ({gf / inv:4.0f})"
                )
    torch.set_num_threads(threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--bench-model", action="store_true", help="batchgen bench's Mixtral")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gemm", action="store_true", help="time the GEMM alone against MKL")
    args = p.parse_args()
    if args.gemm:
        gemm_bench()
        return
    if args.bench_model:
        args.model = bench_model_path("mixtral")
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(args.prompt_len)]}
        for _ in range(args.prompts)
    ]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.prompts)
    ]
    common = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.25)
    engines = {
        mode: LLM(args.model, batch_invariant=mode == "invariant", **common)
        for mode in ("default", "invariant")
    }
    for llm in engines.values():  # warm-up: kernel builds, weight packing
        llm.generate(prompts[:2], params[:2], use_tqdm=False)
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[mode].append(time.perf_counter() - t0)
    tokens = args.prompts * args.max_tokens
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each")
    for mode, ts in times.items():
        t, best = statistics.median(ts), min(ts)
        rounds = ", ".join(f"{x:.2f}" for x in ts)
        print(
            f"{mode:10s} median {t:6.2f} s ({tokens / t:7.1f} tokens/s), "
            f"min {best:6.2f} s ({tokens / best:7.1f} tokens/s); rounds: {rounds}"
        )
    for name, stat in (("median", statistics.median), ("min", min)):
        ratio = stat(times["invariant"]) / stat(times["default"])
        print(f"invariant / default wall time ({name}): {ratio:.2f}x")


if __name__ == "__main__":
    main()
