"""bf16 dense projections on CPU: the `packed_linear` kernel (AMX / vdpbf16ps), oneDNN's
prepacked path and ``F.linear``, alternating in one process; and the fused-MoE kernel as a
one-expert dense MLP.

    .venv/bin/python benchmarks/bf16_linear.py [--rows 1,16,64,70,128,256,512,2048]
        [--models bench,2048] [--reps 30] [--threads N] [--clock wall|cpu] [--no-mlp]

Per model, the dense projections of one layer and the LM head (``bench``: the bench checkpoint,
hidden 512, 8 heads / 2 KV heads of 64, vocab 512, router 64 experts; ``2048``: a Llama-like
hidden 2048, 16 heads / 4 KV heads of 128, dense MLP 5632, vocab 32,000), and per row count,
each path as a module call (`PrepackedLinear`, ``nn.Linear``):

- ``packed``: `PrepackedLinear` forced onto the `packed_linear` kernel at every row count
  (`batchgen.kernels.packed_linear`: AMX tiles on a weight packed once);
- ``onednn``: `PrepackedLinear` with the kernel off (``torch.ops.mkldnn._linear_pointwise`` on
  a weight reordered once by ``_reorder_linear_weight``, what inductor's freezing uses);
- ``F.linear``: torch's bf16 ``F.linear`` (oneDNN matmul on the plain weight, reordered per call);
- ``fp32``: float32 ``F.linear`` on the same weights (MKL), for scale.

and which of the first two the engine's layer picks there (`use_packed_linear`).

Then (unless ``--no-mlp``) the gated MLP ``down(silu(gate(x)) * up(x))`` (``bench``: the
DeepSeek bench model's dense layer, I 1024; ``2048``: I 5632) through the two oneDNN paths and
through the fused MoE kernel with one expert, top-1, weight 1 (`batchgen.kernels.fused_moe`):
candidate (b) of issue 19.

Runs under ``torch.inference_mode`` as the engine does. Prints GFLOP/s (2 M N K per GEMM over
the fastest of ``--reps`` alternated calls) and each path's ratio to ``F.linear``, ``packed``'s
ratio to ``onednn``; the largest difference of ``packed`` and ``onednn`` from ``F.linear`` in
bf16 ulps of the output (0 means bit-identical).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine.host_allocator import tune_glibc_malloc
from batchgen.kernels import fused_moe as fm
from batchgen.kernels import onednn_linear as ol
from batchgen.kernels import packed_linear as pk
from batchgen.models.layers import linear as lin
from batchgen.models.layers.linear import enable_prepacked_linear

# name -> (projections [(label, N, K)], gated MLP (H, I))
MODELS = {
    "bench": (
        [("qkv", 768, 512), ("o", 512, 512), ("router", 64, 512), ("lm_head", 512, 512)],
        (512, 1024),
    ),
    "2048": (
        [
            ("qkv", 3072, 2048),
            ("o", 2048, 2048),
            ("gate_up", 11264, 2048),
            ("down", 2048, 5632),
            ("lm_head", 32000, 2048),
        ],
        (2048, 5632),
    ),
}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _best_times(fns: dict, reps: int) -> dict[str, float]:
    """Fewest seconds of each callable over ``reps`` calls alternated round by round (after one
    warm-up): the minimum, which other jobs on a shared machine disturb least."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = _clock()
            fn()
            times[name].append(_clock() - t0)
    return {name: min(t) for name, t in times.items()}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in bf16 ulps of b (0 for equal tensors)."""
    if a.numel() == 0:
        return 0.0
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(b.float().abs())))
    ulp = torch.where(b == 0, torch.tensor(2.0**-133), ulp)
    return ((a.float() - b.float()).abs() / ulp).max().item()


def _converted(layer: nn.Module, packed_kernel: bool) -> nn.Module:
    """A `PrepackedLinear` copy of ``layer`` with or without the packed_linear kernel."""
    out = copy.deepcopy(layer)
    old = os.environ.get(pk.PACKED_LINEAR_ENV)
    os.environ[pk.PACKED_LINEAR_ENV] = "1" if packed_kernel else "0"
    try:
        enable_prepacked_linear(out)
    finally:
        if old is None:
            del os.environ[pk.PACKED_LINEAR_ENV]
        else:
            os.environ[pk.PACKED_LINEAR_ENV] = old
    return out


def bench_projections(model: str, rows: list[int], reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    limits = (
        lin.PACKED_LINEAR_MAX_MACS_ONE_THREAD,
        lin.PACKED_LINEAR_MAX_MACS,
        lin.PACKED_LINEAR_MAX_MACS_VNNI,
    )
    amx = pk.kernel_isa() == "amx"  # as `PrepackedLinear` reads it
    for label, n, k in MODELS[model][0]:
        plain = nn.Linear(k, n, bias=False).bfloat16()
        with torch.no_grad():
            plain.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
        packed, onednn = _converted(plain, True), _converted(plain, False)
        fp32 = copy.deepcopy(plain).float()
        w = plain.weight
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            x32 = x.float()
            picks = "packed" if lin.use_packed_linear(m, n, k, threads, amx) else "onednn"
            # the packed layer on its kernel at every row count (the limits lifted; the VNNI
            # one too, else a CPU without AMX would time oneDNN twice)
            lin.PACKED_LINEAR_MAX_MACS_ONE_THREAD = lin.PACKED_LINEAR_MAX_MACS = 2**62
            lin.PACKED_LINEAR_MAX_MACS_VNNI = 2**62
            try:
                t = _best_times(
                    {
                        "packed": lambda: packed(x),
                        "onednn": lambda: onednn(x),
                        "F.linear": lambda: plain(x),
                        "fp32": lambda: fp32(x32),
                    },
                    reps if n * k < 10_000_000 else max(3, reps // 4),
                )
                y_packed = packed(x)
            finally:
                (
                    lin.PACKED_LINEAR_MAX_MACS_ONE_THREAD,
                    lin.PACKED_LINEAR_MAX_MACS,
                    lin.PACKED_LINEAR_MAX_MACS_VNNI,
                ) = limits
            gflop = 2 * m * n * k / 1e9
            ref = F.linear(x, w)
            print(
                f"{model:5s} {label:8s} N {n:5d} K {k:4d} rows {m:4d}  GFLOP/s packed "
                f"{gflop / t['packed']:7.1f}  onednn {gflop / t['onednn']:7.1f}  F.linear "
                f"{gflop / t['F.linear']:7.1f}  fp32 {gflop / t['fp32']:7.1f}  "
                f"packed/onednn {t['onednn'] / t['packed']:4.2f}x  "
                f"packed/F.linear {t['F.linear'] / t['packed']:4.2f}x  "
                f"onednn/F.linear {t['F.linear'] / t['onednn']:4.2f}x  layer picks {picks:6s}  "
                f"max diff packed {_ulps(y_packed, ref):.0f} onednn {_ulps(onednn(x), ref):.0f} ulp"
            )


def bench_gated_mlp(model: str, rows: list[int], reps: int) -> None:
    h, i = MODELS[model][1]
    g = torch.Generator().manual_seed(1)
    w13 = (torch.randn(2 * i, h, generator=g) * h**-0.5).bfloat16()
    w2 = (torch.randn(h, i, generator=g) * i**-0.5).bfloat16()
    p13, p2 = ol.pack_onednn_weight(w13), ol.pack_onednn_weight(w2)
    has_moe = fm.kernel_isa(torch.bfloat16) is not None
    if has_moe:
        f13, f2 = fm.pack_expert_weights(w13[None]), fm.pack_expert_weights(w2[None])

    def mlp(linear, a, b):
        def run(x):
            gate, up = linear(x, a).chunk(2, -1)  # [m, I] each
            return linear(F.silu(gate) * up, b)

        return run

    for m in rows:
        x = torch.randn(m, h, generator=g).bfloat16()
        ones, order = torch.ones(m, 1), torch.arange(m)
        fns = {
            "onednn": lambda: mlp(ol.onednn_linear, p13, p2)(x),
            "F.linear": lambda: mlp(F.linear, w13, w2)(x),
        }
        if has_moe:
            fns["fused_moe"] = lambda: fm.fused_moe_silu(x, f13, f2, ones, order, [m]).bfloat16()
        t = _best_times(fns, reps)
        gflop = 6 * m * h * i / 1e9
        cols = "  ".join(
            f"{name} {gflop / s:7.1f} ({t['F.linear'] / s:4.2f}x)" for name, s in t.items()
        )
        print(f"{model:5s} gated MLP H {h} I {i} rows {m:4d}  GFLOP/s (x F.linear)  {cols}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows", default="1,16,64,70,128,256,512,2048", help="row counts, comma-separated"
    )
    p.add_argument("--models", default="bench,2048", help=f"from {sorted(MODELS)}")
    p.add_argument("--reps", type=int, default=30, help="alternated calls per path (fastest)")
    p.add_argument("--no-mlp", action="store_true", help="skip the gated-MLP comparison")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: perf_counter (a quiet machine); cpu: the process's CPU time, which time "
        "slices lost to other jobs do not inflate (a shared machine; with OMP_WAIT_POLICY="
        "PASSIVE so that idle OpenMP threads do not spin)",
    )
    args = p.parse_args()
    global _clock
    _clock = CLOCKS[args.clock]
    tune_glibc_malloc()  # as the engine does
    if args.threads:
        torch.set_num_threads(args.threads)
    if not ol.prepacked_linear_available(
        torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16)
    ):
        raise SystemExit("the oneDNN prepacked bf16 path is not available here (avx512_bf16?)")
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, clock {args.clock}, "
        f"fused MoE bf16 kernel {fm.kernel_isa(torch.bfloat16)}, packed_linear {pk.kernel_isa()}"
    )
    models = args.models.split(",")
    for model in models:
        if model not in MODELS:
            raise SystemExit(f"--models: unknown model {model!r}; choose from {sorted(MODELS)}")
    with torch.inference_mode():
        for model in models:
            bench_projections(model, rows, args.reps)
            if not args.no_mlp:
                bench_gated_mlp(model, rows, args.reps)


if __name__ == "__main__":
    main()
