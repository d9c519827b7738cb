"""The per-layer costs behind the scaling model in docs/distributed.md, measured in one run:

1. the MoE layer's expert compute on one rank (fused CPU kernel, the threads one rank gets),
   as a function of the rows each expert receives;
2. one dispatch + combine pair (`AllToAllDispatcher`) on W local gloo ranks, as a function of
   the tokens per rank: latency and bytes per second.

    python benchmarks/ep_layer_costs.py [--world 2] [--threads 1] [--rounds 5]

Shapes are the bench model's (hidden 512, moe_intermediate 256, 64 experts, top-8). Prints a
table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

H, INTER, E, K = 512, 256, 64, 8


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def expert_compute(threads: int, rounds: int) -> list[dict]:
    from batchgen.models.layers.moe import SparseMoeBlock
    from batchgen.models.model_config import RouterConfig

    torch.set_num_threads(threads)
    block = SparseMoeBlock(H, INTER, E, K, RouterConfig())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    rows = []
    with torch.inference_mode():
        for m in (1, 2, 4, 8, 16, 32, 64, 128):
            n = m * E  # one row per (token, slot) pair: m rows on every expert
            x = torch.randn(n, H)
            ids = torch.arange(n)[:, None] % E
            w = torch.ones(n, 1)
            block.experts(x, w, ids)
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                block.experts(x, w, ids)
                times.append(time.perf_counter() - t0)
            t = _median(times)
            flops = 2 * n * 3 * H * INTER
            rows.append(
                {"rows_per_expert": m, "us_per_row": t / n * 1e6, "gflops": flops / t / 1e9}
            )
    return rows


def _a2a_rank(rank, world, tokens_list, rounds):
    import torch.distributed as dist

    from batchgen.distributed.all_to_all import AllToAllDispatcher
    from batchgen.distributed.layout import ExpertPlacement

    d = AllToAllDispatcher(dist.group.WORLD, ExpertPlacement(E, world))
    out = []
    for t in tokens_list:
        x = torch.randn(t, H)
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(t)]) if t else torch.empty(0, K)
        ids = ids.long()
        w = torch.rand(t, K)
        times = []
        for _ in range(rounds + 1):
            dist.barrier()
            t0 = time.perf_counter()
            recv = d.dispatch(x, ids, w)
            d.combine(recv.hidden, recv.handle)
            times.append(time.perf_counter() - t0)
        sent = 2 * t * K * H * 4 * (world - 1) / world  # payload leaving this rank, both ways
        out.append({"tokens": t, "seconds": _median(times[1:]), "bytes_leaving": sent})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    from dist_helpers import run_ranks

    compute = expert_compute(args.threads, args.rounds)
    tokens = [0, 1, 16, 64, 256, 1024]
    comm = run_ranks(_a2a_rank, args.world, tokens, args.rounds, timeout=600)[0]
    print(
        f"expert compute ({args.threads} threads): rows/expert, us per (token, slot) row, GFLOP/s"
    )
    for r in compute:
        print(f"  {r['rows_per_expert']:>4} {r['us_per_row']:>8.2f} {r['gflops']:>7.1f}")
    print(f"dispatch + combine on {args.world} gloo ranks: tokens/rank, ms, MB/s leaving a rank")
    for r in comm:
        rate = r["bytes_leaving"] / r["seconds"] / 1e6 if r["tokens"] else 0.0
        print(f"  {r['tokens']:>5} {r['seconds'] * 1e3:>8.2f} {rate:>8.1f}")
    print(
        json.dumps({"world": args.world, "threads": args.threads, "compute": compute, "comm": comm})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
