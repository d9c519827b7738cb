"""Per-kernel micro-benchmark for the device run (`benchmarks/gpu_check.sh`): bf16 matmul
TFLOP/s by row count against the chip's peak, the MoE expert path `SparseMoeBlock.experts`
takes on this device by rows per expert, and decode attention through the engine's
`paged_attention` (`gpu_kernels_attention.py`) in GB/s of K/V read against HBM bandwidth, and
(CUDA only) MLA's absorbed decode on the paged latent cache in GB/s of latent read. Writes one
JSON record.

Beside the path the engine picks (``auto``), each part also times the paths it could pick
instead, forced through their variables (``forced`` in the record): on CUDA the MoE experts
on ``grouped_mm`` and ``triton`` (``BATCHGEN_MOE_PATH``), decode attention on ``torch`` and
``triton`` (``BATCHGEN_ATTENTION_BACKEND``): the measurement that decides `expert_path`'s and
`decode_attention_backend`'s ``auto`` on a given GPU. A forced path that cannot run here is
recorded with its error; it does not fail the run. The first call of a Triton path compiles
its kernels (one per tile configuration): the warmup calls absorb it.

    python benchmarks/gpu_kernels.py --device cuda --out $OUT/kernels.json
    python benchmarks/gpu_kernels.py --tiny --device cpu --out /tmp/kernels.json   # seconds on CPU

Peaks (overridable with --peak-tflops / --peak-hbm-gbs): NVIDIA H200 SXM, dense BF16 Tensor
Core 989 TFLOP/s (the datasheet's 1,979 is with 2:4 sparsity) and HBM3e 4.8 TB/s (NVIDIA H200
datasheet, nvidia.com/en-us/data-center/h200). This workplace measured 769-798 TFLOP/s for an
8192^3 bf16 torch.matmul and ~4.3 TB/s for a device-to-device copy on its H200s
(/work/.library/device/KINDS.md), so ~0.8 of the datasheet peak is the attainable ceiling.

Units: TFLOP/s = 1e12 FLOP/s with a matmul of m x k by k x n counted as 2*m*k*n FLOP; GB/s =
1e9 bytes/s. Each figure is the median of ``--iters`` timed calls after ``--warmup`` calls, with
`torch.cuda.synchronize` around each call on CUDA (so launch latency is included, as it is in
the engine's step).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
from gpu_kernels_attention import bench_decode_attention, bench_mla_decode, forced

from batchgen.models.layers.expert_path import MOE_PATH_ENV, expert_path
from batchgen.models.layers.moe import SparseMoeBlock
from batchgen.models.model_config import RouterConfig

H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H200 datasheet, dense (no sparsity)
H200_HBM_GBS = 4800.0  # NVIDIA H200 datasheet, HBM3e 4.8 TB/s

DECODE_ROWS = [1, 8, 32, 64, 128, 256]
PREFILL_ROWS = [1024, 4096, 16384]
ROWS_PER_EXPERT = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def _timer(device: torch.device, warmup: int, iters: int):
    """``time(fn) -> median seconds`` of ``iters`` calls after ``warmup`` calls."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def time_fn(fn) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return time_fn


def bench_matmul(args, device, dtype, time_fn) -> list[dict]:
    """``x [m, K] @ W[N, K]^T`` (`F.linear`, as the engine's projections run) for each m."""
    k, n = args.matmul_k, args.matmul_n
    w = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
    rows = []
    for m in args.decode_rows + args.prefill_rows:
        x = torch.randn(m, k, device=device, dtype=dtype)
        secs = time_fn(lambda x=x: torch.nn.functional.linear(x, w))
        tflops = 2 * m * k * n / secs / 1e12
        phase = "decode" if m in args.decode_rows else "prefill"
        rows.append(
            dict(
                phase=phase,
                m=m,
                k=k,
                n=n,
                ms=secs * 1e3,
                tflops=tflops,
                share_of_peak=tflops / args.peak_tflops,
            )
        )
    return rows


def balanced_routing(rows_per_expert: int, num_experts: int, top_k: int, device):
    """``(T, topk_weights [T, A] float32, topk_ids [T, A])`` with every expert getting exactly
    ``rows_per_expert`` rows: token t's slot a goes to expert ``(t * A + a) % E`` (distinct
    experts per token since A <= E). ``T = rows_per_expert * E / A``, rounded up, so the count
    is exact when A divides ``rows_per_expert * E``."""
    num_tokens = -(-rows_per_expert * num_experts // top_k)
    t = torch.arange(num_tokens, device=device)[:, None]
    ids = (t * top_k + torch.arange(top_k, device=device)) % num_experts  # [T, A]
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, device=device)
    return num_tokens, weights, ids


def bench_moe(args, device, dtype, time_fn) -> dict:
    """`SparseMoeBlock.experts` (the path the engine's MoE layer takes on this device) at each
    rows-per-expert count, then the same with each of ``--moe-paths`` forced; FLOP = 6 * H * I
    per routed row (gate/up 2*H*2I, down 2*I*H)."""
    h, inter, e, a = args.hidden, args.moe_intermediate, args.num_experts, args.top_k
    if a > e:
        raise SystemExit(f"--top-k ({a}) must be <= --num-experts ({e})")
    block = SparseMoeBlock(h, inter, e, a, RouterConfig())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=h**-0.5)
    block = block.to(device=device, dtype=dtype).eval()
    with forced(MOE_PATH_ENV, "auto"):
        path, rows = _moe_rows(block, args, device, dtype, time_fn)
    record = dict(
        hidden=h,
        moe_intermediate=inter,
        num_experts=e,
        top_k=a,
        path=path,
        top_ops=_top_ops(block, args, device, dtype),
        rows=rows,
        forced={},
    )
    for name in args.moe_paths:
        try:
            with forced(MOE_PATH_ENV, name):
                _, rows = _moe_rows(block, args, device, dtype, time_fn)
            record["forced"][name] = dict(rows=rows)
        except Exception as exc:  # recorded: an alternative path, not the engine's
            record["forced"][name] = dict(error=f"{type(exc).__name__}: {exc}")
    return record


def _moe_rows(block, args, device, dtype, time_fn) -> tuple[str, list[dict]]:
    """``(the expert path taken, one timing row per rows-per-expert count)``."""
    h, inter, e, a = args.hidden, args.moe_intermediate, args.num_experts, args.top_k
    rows, path = [], None
    with torch.inference_mode():
        for m in args.rows_per_expert:
            num_tokens, weights, ids = balanced_routing(m, e, a, device)
            x = torch.randn(num_tokens, h, device=device, dtype=dtype)
            if path is None:
                path = expert_path(
                    device, dtype, batch_invariant=False, cpu_kernel=block.uses_kernel(x),
                    hidden_size=h, intermediate_size=inter, num_experts=e,
                )  # fmt: skip
            secs = time_fn(lambda x=x, w=weights, i=ids: block.experts(x, w, i))
            routed = num_tokens * a
            tflops = 6 * h * inter * routed / secs / 1e12
            rows.append(
                dict(
                    rows_per_expert=m,
                    num_tokens=num_tokens,
                    ms=secs * 1e3,
                    tflops=tflops,
                    share_of_peak=tflops / args.peak_tflops,
                )
            )
    return path, rows


def _top_ops(block, args, device, dtype) -> list[str]:
    """Names of the operators that took most time in one `experts` call at 64 rows per
    expert (which kernel the path launches), from torch.profiler; [] if it fails."""
    try:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        num_tokens, weights, ids = balanced_routing(64, args.num_experts, args.top_k, device)
        x = torch.randn(num_tokens, args.hidden, device=device, dtype=dtype)
        with torch.inference_mode(), profile(activities=acts) as prof:
            block.experts(x, weights, ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=6)
        return table.splitlines()[:10]
    except Exception as exc:  # the profiler is a diagnostic: its failure is reported, not fatal
        return [f"profiler failed: {type(exc).__name__}: {exc}"]


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", default=None, help="write the JSON record here (also printed)")
    p.add_argument("--parts", default="matmul,moe,attention,mla", help="comma-separated subset")
    p.add_argument(
        "--tiny", action="store_true", help="tiny sizes and few iterations (CPU self-test)"
    )
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--peak-hbm-gbs", type=float, default=H200_HBM_GBS)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    g = p.add_argument_group("matmul (default: Llama-3-8B's MLP up projection, 4096 x 14336)")
    g.add_argument("--matmul-k", type=int, default=4096)
    g.add_argument("--matmul-n", type=int, default=14336)
    g.add_argument("--decode-rows", type=_ints, default=DECODE_ROWS)
    g.add_argument("--prefill-rows", type=_ints, default=PREFILL_ROWS)
    g = p.add_argument_group("MoE experts (default: Qwen3-30B-A3B's layer: 128 experts, top-8)")
    g.add_argument("--hidden", type=int, default=2048)
    g.add_argument("--moe-intermediate", type=int, default=768)
    g.add_argument("--num-experts", type=int, default=128)
    g.add_argument("--top-k", type=int, default=8)
    g.add_argument("--rows-per-expert", type=_ints, default=ROWS_PER_EXPERT)
    g = p.add_argument_group("decode attention (default: Llama-3-8B's, 32 q / 8 KV heads of 128)")
    g.add_argument("--num-heads", type=int, default=32)
    g.add_argument("--num-kv-heads", type=int, default=8)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--decode-seqs", type=_ints, default=[64, 256])
    g.add_argument("--contexts", type=_ints, default=[1024, 4096])
    g = p.add_argument_group("MLA decode on the latent cache (default: DeepSeek-V3's layer)")
    g.add_argument("--mla-heads", type=int, default=128)
    g.add_argument("--kv-lora-rank", type=int, default=512)
    g.add_argument("--qk-rope-head-dim", type=int, default=64)
    g = p.add_argument_group("alternatives timed beside the engine's choice")
    g.add_argument(
        "--moe-paths", default=None, help="forced MoE paths to time too (default on CUDA: "
        "grouped_mm,triton; none on CPU)",
    )  # fmt: skip
    g.add_argument(
        "--attention-backends", default=None, help="forced decode backends to time too "
        "(default on CUDA: torch,triton; none on CPU)",
    )  # fmt: skip
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if args.moe_paths is None:
        args.moe_paths = "grouped_mm,triton" if cuda else ""
    if args.attention_backends is None:
        args.attention_backends = "torch,triton" if cuda else ""
    args.moe_paths = [x for x in args.moe_paths.split(",") if x]
    args.attention_backends = [x for x in args.attention_backends.split(",") if x]
    if args.tiny:
        args.warmup, args.iters = 1, 2
        args.matmul_k, args.matmul_n = 64, 96
        args.decode_rows, args.prefill_rows = [1, 8], [64]
        args.hidden, args.moe_intermediate, args.num_experts, args.top_k = 64, 32, 8, 2
        args.rows_per_expert = [1, 4, 16]
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 32
        args.decode_seqs, args.contexts = [4], [64]
        args.mla_heads, args.kv_lora_rank, args.qk_rope_head_dim = 4, 32, 16
    if args.num_heads % args.num_kv_heads:
        p.error(f"--num-heads ({args.num_heads}) must be a multiple of --num-kv-heads")
    args.parts = [x for x in args.parts.split(",") if x]
    bad = set(args.parts) - {"matmul", "moe", "attention", "mla"}
    if bad:
        p.error(f"--parts: unknown {sorted(bad)}; allowed matmul,moe,attention,mla")
    return args


def main(argv=None) -> int:
    """Run the selected parts; each part's failure is recorded in the JSON (``error``) and
    makes the exit status 1, the other parts still run."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    time_fn = _timer(device, args.warmup, args.iters)
    record = dict(
        device=args.device,
        device_name=(
            torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        ),
        dtype=args.dtype,
        torch=torch.__version__,
        peak_tflops=args.peak_tflops,
        peak_hbm_gbs=args.peak_hbm_gbs,
        tiny=args.tiny,
    )
    parts = {
        "matmul": bench_matmul,
        "moe": bench_moe,
        "attention": bench_decode_attention,
        "mla": bench_mla_decode,
    }
    failed = False
    for name in args.parts:
        t0 = time.perf_counter()
        try:
            record[name] = parts[name](args, device, dtype, time_fn)
        except Exception as exc:  # recorded: the device run needs every part's outcome
            failed = True
            record[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    text = json.dumps(record, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
