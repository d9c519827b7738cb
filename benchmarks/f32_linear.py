"""float32 dense projections on CPU: ``F.linear`` (MKL's sgemm in torch's x86 builds) against
oneDNN's inner product on a weight reordered once, alternating in one process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/f32_linear.py \\
        [--rows 1,2,4,8,16,32,70,128,257,1024,2048] [--threads 1] [--rounds 7] [--vary]

    # with vLLM's ``onednn_mm`` (its CPU backend's path for these layers) beside them:
    PYTHONPATH=$PWD benchmarks/peers/.venv-vllm/bin/python benchmarks/f32_linear.py ...

The bench model's projections (hidden 512: qkv 768 x 512, o 512 x 512, router 64 x 512,
lm_head 512 x 512). Paths, each called as the engine would:

- ``linear``: ``F.linear`` on the plain weight (the float32 path before issue 19's dense round);
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on ``_reorder_linear_weight`` of the
  weight, at the exact row count;
- ``onednn_b``: the same with the rows padded to `onednn_bucket_rows`;
- ``layer``: `PrepackedLinear` as the engine converts it (`enable_prepacked_linear` with
  ``BATCHGEN_ONEDNN_LINEAR_F32=onednn``: `use_onednn_f32` picks ``linear`` or ``onednn_b``);
- ``vllm``: vLLM's ``onednn_mm`` handler, when vLLM imports.

Each row count: ``--rounds`` rounds, the paths in a rotated order each round, each a loop of
calls (about 2e8 multiply-adds, 5-200 calls) timed with the process CPU time (all threads;
counts the work, not the waiting, on a shared machine); prints the median microseconds per
call, GFLOP/s (2 M N K) and each path's speed-up over ``linear``, and ``=`` where its output
is bit-identical to ``linear``'s, else ``~`` and the largest absolute difference from a float64
product divided by ``linear``'s. ``--vary`` gives each call a new row count in ``(M/2, M]``
(the same counts for every path), as an engine's prefill chunks have.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

SHAPES = [("qkv", 768, 512), ("o", 512, 512), ("router", 64, 512), ("lm_head", 512, 512)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,70,128,257,1024,2048")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--vary", action="store_true", help="a new row count per call, in (M/2, M]")
    p.add_argument("--shapes", default="qkv,o,router,lm_head")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["BATCHGEN_ONEDNN_LINEAR_F32"] = "onednn"
    from batchgen.models.layers import linear as lin

    try:
        import vllm._custom_ops as ops
    except ImportError:
        ops = None
    print(f"torch {torch.__version__}, {args.threads} threads, process clock, float32")
    torch.manual_seed(0)
    wanted = args.shapes.split(",")
    with torch.inference_mode():
        for label, n, k in (s for s in SHAPES if s[0] in wanted):
            w = torch.randn(n, k) * k**-0.5
            layer = nn.Linear(k, n, bias=False)
            layer.weight.data.copy_(w)
            assert lin.enable_prepacked_linear(layer) == 1
            dnn = torch.ops.mkldnn._reorder_linear_weight(w, None)
            paths = {
                "linear": lambda: F.linear(x, w),
                "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, dnn, None, "none", [], ""),
                "onednn_b": lambda: lin._onednn_bucketed(x, dnn, None, k),
                "layer": lambda: layer(x),
            }
            if ops is not None:
                vd = ops.create_onednn_mm(w.t(), 32)
                paths["vllm"] = lambda: ops.onednn_mm(vd, x, None)
            names = list(paths)
            for m in (int(r) for r in args.rows.split(",")):
                xs = torch.randn(m, k)
                x = xs
                ref = F.linear(x.double(), w.double())
                base = (paths["linear"]() - ref).abs().max().item()
                same = {nm: torch.equal(fn(), paths["linear"]()) for nm, fn in paths.items()}
                err = {nm: (fn() - ref).abs().max().item() / base for nm, fn in paths.items()}
                calls = max(5, min(200, int(2e8 / (m * n * k))))
                times: dict[str, list[float]] = {nm: [] for nm in names}
                for r in range(args.rounds):
                    gen = torch.Generator().manual_seed(1000 * r + m)
                    counts = (
                        torch.randint(m // 2 + 1, m + 1, (calls,), generator=gen)
                        if args.vary
                        else torch.full((calls,), m)
                    ).tolist()
                    for nm in names[r % len(names) :] + names[: r % len(names)]:
                        fn = paths[nm]
                        x = xs
                        fn()
                        total = 0.0
                        for c in counts:
                            x = xs[:c]
                            t0 = time.process_time()
                            fn()
                            total += time.process_time() - t0
                        times[nm].append(total / calls * 1e6)
                med = {nm: statistics.median(v) for nm, v in times.items()}
                flops = 2 * (0.75 * m if args.vary else m) * n * k
                cells = "  ".join(
                    f"{nm} {med[nm]:8.1f}us {flops / med[nm] / 1e3:4.0f}GF "
                    f"{med['linear'] / med[nm]:4.2f}x {'=' if same[nm] else '~'}{err[nm]:.1f}"
                    for nm in names
                )
                print(f"{label:7s} M {m:5d}  {cells}", flush=True)


if __name__ == "__main__":
    main()
