"""One MoE layer on CPU: the fused kernel (`batchgen.kernels.fused_moe`) beside the per-expert
torch path (`fused_experts_per_expert`), alternating in one process.

    .venv/bin/python benchmarks/moe_layer.py [--tokens 64,512,1024,2048,4096] [--rounds 3]
        [--paths torch,kernel,avx2,bf16,vdpbf16ps,amx,torch_bf16]

Bench-model shapes by default (64 experts, top-8, hidden 512, expert intermediate 256, random
softmax routing). Paths: ``torch`` (per-expert torch, float32), ``kernel`` (the fused kernel's
best float32 micro-kernel: AVX-512F where the build has it), ``avx2`` (the fused kernel forced
to its AVX2 micro-kernel), ``bf16`` (the fused kernel on bf16 weights and activations, where
the CPU has avx512_bf16; its best micro-kernel: AMX where usable), ``vdpbf16ps`` and ``amx``
(the bf16 kernel forced to that micro-kernel), ``torch_bf16`` (per-expert torch in bf16).
Prints one line per token count: the median milliseconds of each path, each one's speed-up
over the first path and GFLOP/s (6 * H * I FLOPs per routed row), and the largest absolute
difference of each path's output from the first path's.
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
    p.add_argument("--paths", default="torch,kernel")
    args = p.parse_args()
    tune_glibc_malloc()  # as the engine does
    e, a, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    w13_b, w2_b = w13.bfloat16(), w2.bfloat16()
    w13_packed, w2_packed = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    w13_pb, w2_pb = fm.pack_expert_weights(w13_b), fm.pack_expert_weights(w2_b)
    names = args.paths.split(",")
    print(
        f"torch threads {torch.get_num_threads()}, E {e}, top-{a}, H {h}, I {i}, "
        f"float32 kernel {fm.kernel_isa(torch.float32)}, "
        f"bf16 kernel {fm.kernel_isa(torch.bfloat16)}"
    )
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(num_tokens, h, generator=g)
        weights, ids = torch.topk(torch.softmax(torch.randn(num_tokens, e, generator=g), -1), a)
        weights = weights / weights.sum(-1, keepdim=True)
        workers = moe.cpu_expert_workers(num_tokens, a, e)
        xb = x.bfloat16()

        def kernel(x, w13p, w2p, isa="auto", weights=weights, ids=ids):
            order, counts = moe.sort_by_expert(ids, e)
            return fm.fused_moe_silu(x, w13p, w2p, weights, order, counts, isa=isa)

        paths = {
            "torch": lambda: moe.fused_experts_per_expert(
                x, w13, w2, weights, ids, num_workers=workers
            ),
            "torch_bf16": lambda: moe.fused_experts_per_expert(
                xb, w13_b, w2_b, weights, ids, num_workers=workers
            ).float(),
            "kernel": lambda: kernel(x, w13_packed, w2_packed),
            "avx2": lambda: kernel(x, w13_packed, w2_packed, "avx2"),
            "bf16": lambda: kernel(xb, w13_pb, w2_pb),
            "vdpbf16ps": lambda: kernel(xb, w13_pb, w2_pb, "avx512_bf16"),
            "amx": lambda: kernel(xb, w13_pb, w2_pb, "amx"),
        }
        times: dict[str, list[float]] = {k: [] for k in names}
        for _ in range(args.rounds):
            for name in names:
                paths[name]()  # warm
                t0 = time.perf_counter()
                paths[name]()
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        first = paths[names[0]]()
        cells = []
        for k in names:
            gflops = num_tokens * a * 6 * h * i / med[k] / 1e9
            diff = (paths[k]() - first).abs().max().item()
            cells.append(
                f"{k} {med[k] * 1e3:7.1f} ms x{med[names[0]] / med[k]:4.2f} "
                f"{gflops:5.1f} GF/s d{diff:.0e}"
            )
        print(f"tokens {num_tokens:>5}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
