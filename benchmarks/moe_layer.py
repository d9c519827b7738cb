"""One MoE layer on CPU: the fused kernel (`batchgen.kernels.fused_moe`) beside the per-expert
torch path (`fused_experts_per_expert`), alternating in one process.

    .venv/bin/python benchmarks/moe_layer.py [--tokens 64,512,1024,2048,4096] [--rounds 3]

Bench-model shapes by default (64 experts, top-8, hidden 512, expert intermediate 256, float32,
random softmax routing). Prints one line per token count: the median milliseconds of each path,
their ratio and the kernel's GFLOP/s (6 * H * I FLOPs per routed row), and the largest absolute
difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.engine.host_allocator import tune_glibc_malloc
from batchgen.kernels import fused_moe as fm
from batchgen.models.layers import moe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="64,512,1024,2048,4096")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tune_glibc_malloc()  # as the engine does
    e, a, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    w13_packed, w2_packed = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    print(f"torch threads {torch.get_num_threads()}, E {e}, top-{a}, H {h}, I {i}")
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(num_tokens, h, generator=g)
        weights, ids = torch.topk(torch.softmax(torch.randn(num_tokens, e, generator=g), -1), a)
        weights = weights / weights.sum(-1, keepdim=True)
        workers = moe.cpu_expert_workers(num_tokens, a, e)

        def torch_path(x=x, weights=weights, ids=ids, workers=workers):
            return moe.fused_experts_per_expert(x, w13, w2, weights, ids, num_workers=workers)

        def kernel(x=x, weights=weights, ids=ids):
            order, counts = moe.sort_by_expert(ids, e)
            return fm.fused_moe_silu(x, w13_packed, w2_packed, weights, order, counts)

        times: dict[str, list[float]] = {"torch": [], "kernel": []}
        for _ in range(args.rounds):
            for name, fn in (("torch", torch_path), ("kernel", kernel)):
                fn()  # warm
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        t_torch, t_kernel = (statistics.median(times[k]) for k in ("torch", "kernel"))
        diff = (torch_path() - kernel()).abs().max().item()
        gflops = num_tokens * a * 6 * h * i / t_kernel / 1e9
        print(
            f"tokens {num_tokens:>6}: torch {t_torch * 1e3:8.1f} ms  "
            f"kernel {t_kernel * 1e3:8.1f} ms  x{t_torch / t_kernel:4.2f}  "
            f"kernel {gflops:6.1f} GFLOP/s  max|diff| {diff:.1e}"
        )


if __name__ == "__main__":
    main()
