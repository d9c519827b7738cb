"""One MoE layer's routed experts: the grouped-GEMM path (`fused_experts_grouped_mm`, two
``torch._grouped_mm`` calls) beside the reference per-expert loop (`fused_experts_reference`),
alternating in one process, on whatever device is given.

    python benchmarks/grouped_moe.py [--device cuda] [--dtype bfloat16]
        [--rows 1,2,4,...,4096] [--experts 64] [--top-k 8] [--hidden 512] [--intermediate 256]
        [--rounds 5]

``--rows`` counts routed rows (token activations, T * top-k); the tokens are rows / top-k
(at least 1), routed by a random softmax router, so experts get uneven and sometimes zero rows
as in an engine step. Prints one line per row count: the median milliseconds of each path per
call, its TFLOP/s (6 * H * I FLOPs per routed row: gate/up 2 * H * 2I, down 2 * I * H), the
grouped path's speed-up over the reference, and the largest absolute difference between them.
On CUDA every timing synchronises the device first and after. Bench-model shapes by default.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.kernels.grouped_moe import fused_experts_grouped_mm, grouped_mm_fast_on
from batchgen.models.layers.moe import fused_experts_reference

DEFAULT_ROWS = ",".join(str(2**k) for k in range(13))  # 1 .. 4096


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rows", default=DEFAULT_ROWS, help="routed rows (T * top-k), comma-separated")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5, help="timed calls per path (after a warm-up)")
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    e, a, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(device, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(device, dtype)
    fast = grouped_mm_fast_on(device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"# device {device} ({name}), {dtype}, E {e} top-{a} H {h} I {i}; "
        f"grouped_mm CUTLASS kernel: {fast}"
    )
    print("rows  tokens  ref_ms  ref_TFLOP/s  grouped_ms  grouped_TFLOP/s  speedup  max_abs_diff")
    for rows in (int(r) for r in args.rows.split(",")):
        t = max(1, rows // a)
        x = torch.randn(t, h, generator=g).to(device, dtype)
        logits = torch.randn(t, e, generator=g).to(device)
        topk_weights, topk_ids = torch.topk(torch.softmax(logits, -1), a, dim=-1)
        paths = {
            "ref": lambda: fused_experts_reference(x, w13, w2, topk_weights, topk_ids),
            "grouped": lambda: fused_experts_grouped_mm(x, w13, w2, topk_weights, topk_ids),
        }
        outs = {name: fn() for name, fn in paths.items()}  # warm-up
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):  # alternate the paths
            for name, fn in paths.items():
                times[name].append(_time_ms(fn, device))
        ms = {name: statistics.median(v) for name, v in times.items()}
        flops = 6 * h * i * t * a
        diff = (outs["grouped"].float() - outs["ref"].float()).abs().max().item()
        print(
            f"{t * a:5d}  {t:6d}  {ms['ref']:6.3f}  {flops / ms['ref'] / 1e9:11.4f}  "
            f"{ms['grouped']:10.3f}  {flops / ms['grouped'] / 1e9:15.4f}  "
            f"{ms['ref'] / ms['grouped']:7.2f}  {diff:.3g}"
        )


if __name__ == "__main__":
    main()
