"""The per-layer costs behind the scaling model in docs/distributed.md, measured in one run:

1. the MoE layer's expert compute on one rank (fused CPU kernel, the threads one rank gets),
   as a function of the rows each expert receives;
2. one dispatch + combine pair (`AllToAllDispatcher`) on W local gloo ranks, as a function of
   the tokens per rank: latency and bytes per second.

    python benchmarks/ep_layer_costs.py [--world 2] [--threads 1] [--rounds 5]
        [--predict 8,64] [--tokens-per-rank 256] [--moe-share 0.5]

3. the scaling model of docs/distributed.md ("What the layout predicts"), evaluated with the
   costs just measured for each expert-parallel group size in ``--predict``.

Shapes are the bench model's (hidden 512, moe_intermediate 256, 64 experts, top-8). Prints
tables and a JSON line.
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


def _a2a_rank(rank, world, tokens_list, rounds, transport="gloo"):
    import os

    import torch.distributed as dist

    from batchgen.distributed.all_to_all import AllToAllDispatcher
    from batchgen.distributed.layout import ExpertPlacement
    from batchgen.distributed.transport import make_transport

    os.environ["BATCHGEN_A2A_TRANSPORT"] = transport
    link = make_transport(dist.group.WORLD, torch.device("cpu"), 300.0)
    d = AllToAllDispatcher(dist.group.WORLD, ExpertPlacement(E, world), transport=link)
    out = []
    for t in tokens_list:
        x = torch.randn(t, H)
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(t)]) if t else torch.empty(0, K)
        ids = ids.long()
        w = torch.rand(t, K)
        times = []
        for _ in range(rounds + 1):
            dist.barrier()
            before = d.stats.bytes_sent
            t0 = time.perf_counter()
            recv = d.dispatch(x, ids, w)
            d.combine(recv.hidden, recv.handle)
            times.append(time.perf_counter() - t0)
            sent = d.stats.bytes_sent - before  # payload leaving this rank, both ways
        out.append({"tokens": t, "seconds": _median(times[1:]), "bytes_leaving": sent})
    link.close()
    return out


def bytes_per_token(world: int, elem_bytes: int = 4) -> float:
    """Bytes leaving a rank per token per MoE layer, dispatch + combine, routing uniform:
    a token's row goes once to each *remote* rank owning at least one of its K experts
    (expected ``(W-1)(1-(1-1/W)^K)`` ranks, H * elem_bytes + 8K bytes of ids and weights each);
    each of its ``K (W-1) / W`` remote (token, slot) pairs comes back as H float32 values."""
    if world == 1:
        return 0.0
    owners = (world - 1) * (1 - (1 - 1 / world) ** K)
    return owners * (H * elem_bytes + 8 * K) + K * (world - 1) / world * H * 4


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise log-log interpolation of measured ``(x, y)``; clamped outside the range."""
    import math

    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    raise AssertionError


def predict(
    compute, comm, world_measured, worlds, tokens_per_rank, moe_share, network=None
) -> list[dict]:
    """The scaling model (docs/distributed.md). Per MoE layer and step, a rank with B tokens:

    - alone (all E experts, W = 1): ``B K c(B K / E)``, c(m) = measured seconds per row at m
      rows per expert;
    - in a group of W: ``B K c(W B K / E) + alpha_W + B bytes_per_token(W) / beta``. Its E/W
      experts see every rank's tokens: W times the rows each, so c falls (coalescing across
      ranks). alpha_W = (W-1) alpha_1: gloo's all-to-all is W-1 pairwise exchanges, alpha_1 the
      measured zero-token dispatch + combine time divided by (W_measured - 1); beta the measured
      bytes per second leaving a rank at the largest size.
    - the step: the MoE layers are ``moe_share`` of a lone rank's step time, the rest
      (attention, dense) unchanged by W. ``speed`` = lone step / grouped step per rank.

    ``network``: ``(alpha_1 seconds, beta bytes/s)`` to use instead of the measured ones (an
    assumed interconnect).
    """
    points = [(r["rows_per_expert"], r["us_per_row"] * 1e-6) for r in compute]
    zero = next(r["seconds"] for r in comm if r["tokens"] == 0)
    alpha_1 = zero / max(1, world_measured - 1)
    big = max(comm, key=lambda r: r["tokens"])
    beta = big["bytes_leaving"] / max(1e-9, big["seconds"] - zero)
    if network is not None:
        alpha_1, beta = network
    b = tokens_per_rank
    alone = b * K * _interp(points, b * K / E)
    rest = alone * (1 - moe_share) / moe_share
    out = []
    for w in worlds:
        compute_s = b * K * _interp(points, w * b * K / E)
        comm_s = (w - 1) * alpha_1 + b * bytes_per_token(w) / beta
        out.append(
            {
                "world": w,
                "rows_per_expert": w * b * K / E,
                "compute_ms": compute_s * 1e3,
                "comm_ms": comm_s * 1e3,
                "alone_ms": alone * 1e3,
                "kb_per_token": bytes_per_token(w) / 1e3,
                "speed": (rest + alone) / (rest + compute_s + comm_s),
                "alpha_1_ms": alpha_1 * 1e3,
                "beta_mb_s": beta / 1e6,
            }
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--transport",
        default="gloo",
        help="all-to-all transport(s), comma-separated: gloo, shm (shared memory); the first is "
        "the one the scaling model uses; several: their dispatch + combine tables side by side",
    )
    p.add_argument("--predict", default="2,8,64", help="group sizes for the scaling model")
    p.add_argument("--tokens-per-rank", type=int, default=256, help="B: decode tokens per step")
    p.add_argument(
        "--moe-share",
        type=float,
        default=0.5,
        help="the MoE layers' share of a lone rank's step time (about half in the profiles of "
        "docs/distributed.md)",
    )
    p.add_argument(
        "--network",
        default="0.1,3",
        help="an assumed interconnect for a second table: 'alpha_ms,GB/s' per rank and pairwise "
        "exchange (default 0.1 ms, 3 GB/s: 25 Gb/s Ethernet); empty: none",
    )
    args = p.parse_args()
    from dist_helpers import run_ranks

    compute = expert_compute(args.threads, args.rounds)
    tokens = [0, 1, 16, 64, 256, 1024]
    transports = args.transport.split(",")
    comms = [  # in the order given: "gloo,shm,gloo,shm" alternates them under varying load
        (name, run_ranks(_a2a_rank, args.world, tokens, args.rounds, name, timeout=600)[0])
        for name in transports
    ]
    comm = comms[0][1]
    print(
        f"expert compute ({args.threads} threads): rows/expert, us per (token, slot) row, GFLOP/s"
    )
    for r in compute:
        print(f"  {r['rows_per_expert']:>4} {r['us_per_row']:>8.2f} {r['gflops']:>7.1f}")
    for name, rows in comms:
        print(
            f"dispatch + combine on {args.world} local ranks over {name}: tokens/rank, ms, "
            "MB/s leaving a rank"
        )
        for r in rows:
            rate = r["bytes_leaving"] / r["seconds"] / 1e6 if r["tokens"] else 0.0
            print(f"  {r['tokens']:>5} {r['seconds'] * 1e3:>8.2f} {rate:>8.1f}")
    worlds = [int(w) for w in args.predict.split(",")]
    model = predict(compute, comm, args.world, worlds, args.tokens_per_rank, args.moe_share)
    print(
        f"scaling model at B={args.tokens_per_rank} tokens/rank, MoE share {args.moe_share}: "
        "W, rows/expert, expert ms, a2a ms (alone: expert ms), KB/token/layer, speed per rank"
    )
    tables = [("measured gloo network", model)]
    if args.network:
        alpha_ms, gb_s = (float(v) for v in args.network.split(","))
        network = (alpha_ms * 1e-3, gb_s * 1e9)
        assumed = predict(
            compute, comm, args.world, worlds, args.tokens_per_rank, args.moe_share, network
        )
        tables.append((f"assumed network: {alpha_ms} ms per exchange, {gb_s} GB/s", assumed))
    for title, rows in tables:
        r0 = rows[0]
        print(f" {title} (alpha_1 {r0['alpha_1_ms']:.3f} ms, beta {r0['beta_mb_s']:.0f} MB/s)")
        for r in rows:
            print(
                f"  {r['world']:>3} {r['rows_per_expert']:>7.1f} {r['compute_ms']:>7.2f} "
                f"{r['comm_ms']:>7.2f} ({r['alone_ms']:.2f}) {r['kb_per_token']:>6.1f} "
                f"{r['speed']:>5.2f}x"
            )
    print(
        json.dumps(
            {
                "world": args.world,
                "threads": args.threads,
                "compute": compute,
                "comm": comm,
                "comm_by_transport": [{"transport": n, "comm": c} for n, c in comms],
                "model": dict(tables),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
