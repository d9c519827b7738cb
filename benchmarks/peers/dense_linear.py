"""vLLM's CPU dense-linear paths against BatchGen's, alone, in one process: same bf16 weights.

    PYTHONPATH=$PWD benchmarks/peers/.venv-vllm/bin/python benchmarks/peers/dense_linear.py \\
        --rows 1,70,257,2048 [--threads 1] [--clock process] [--cold] [--vary]

Runs in vLLM's venv (its ``torch.ops._C`` kernels) with this repository on ``PYTHONPATH``. The
shapes are the bench model's projections (hidden 512: qkv 768 x 512, o 512 x 512, router
64 x 512, lm_head 512 x 512) and, with ``--shapes qkv2048,o2048``, a hidden-2048 model's.
Paths, each called as the engines call them:

- ``bg_packed``: BatchGen's `packed_linear` kernel (AMX tiles on a weight packed once);
- ``bg_onednn``: oneDNN's prepacked inner product (``torch.ops.mkldnn._linear_pointwise``)
  at the exact row count (BatchGen's path before its row buckets);
- ``bg_onednn_b``: the same with the rows padded to `onednn_bucket_rows` (BatchGen's oneDNN
  path now);
- ``bg_layer``: `PrepackedLinear` as the engine runs it (it picks one of the two above,
  `use_packed_linear`);
- ``vllm_sgl``: vLLM's ``weight_packed_linear`` (SGLang's CPU kernel; vLLM uses it for weights
  of at most 1 MiB, i.e. the router here, and oneDNN for the rest);
- ``vllm_onednn``: vLLM's ``onednn_mm`` handler (its path for qkv/o/lm_head).

Each row count: ``--rounds`` rounds, the paths in a rotated order each round, each a loop of
``--calls`` calls; prints the median microseconds per call per path, GFLOP/s (2 M N K) and the
ratio of each to ``bg_layer``. ``--clock process`` times with the process CPU time (all threads
together; far less noisy on a shared machine). ``--cold`` writes a 64 MiB buffer before each
call (untimed), as the expert GEMMs between two projections of an engine step evict the caches;
the call then reads its weight from memory. ``--vary`` gives each call a new row count,
drawn from ``(M/2, M]`` with a seed per round (the same counts for every path), as prefill
chunks of an engine's steps have: oneDNN then builds a primitive for nearly every call.
Also prints the largest difference from
``bg_onednn`` in bf16 ulps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = [
    ("qkv", 768, 512),
    ("o", 512, 512),
    ("router", 64, 512),
    ("lm_head", 512, 512),
    ("qkv2048", 3072, 2048),  # a Llama-like hidden-2048 model's (16 heads / 4 KV heads of 128)
    ("o2048", 2048, 2048),
]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return int((ia - ib).abs().max()) if a.numel() else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,70,257,2048")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", default="process", choices=["wall", "process"])
    p.add_argument("--cold", action="store_true", help="evict the caches before each call")
    p.add_argument("--vary", action="store_true", help="a new row count per call, in (M/2, M]")
    p.add_argument("--shapes", default="qkv,o,router,lm_head")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import vllm._custom_ops as ops

    from batchgen.kernels import packed_linear as pk
    from batchgen.kernels.onednn_linear import pack_onednn_weight
    from batchgen.models.layers import linear as lin
    from batchgen.models.layers.linear import enable_prepacked_linear

    if not torch._C._cpu._init_amx():
        raise SystemExit("this CPU or kernel grants no AMX tile state")
    clock = time.process_time if args.clock == "process" else time.perf_counter
    flush = torch.empty(64 * 2**20 // 4, dtype=torch.float32)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.clock} clock, "
        f"{'cold' if args.cold else 'warm'} caches, bf16, packed_linear isa {pk.kernel_isa()}"
    )
    torch.manual_seed(0)
    wanted = args.shapes.split(",")
    with torch.inference_mode():
        for label, n, k in (s for s in SHAPES if s[0] in wanted):
            w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
            layer = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
            layer.weight.data.copy_(w)
            enable_prepacked_linear(layer)
            bg_pk = pk.pack_packed_linear_weight(w)
            bg_dnn = pack_onednn_weight(w)
            v_sgl = torch.ops._C.convert_weight_packed(w)
            v_dnn = ops.create_onednn_mm(w.t(), 32)
            for m in (int(r) for r in args.rows.split(",")):
                xs = torch.randn(m, k).to(torch.bfloat16)
                x = xs
                paths = {
                    "bg_layer": lambda: layer(x),
                    "bg_packed": lambda: pk.packed_linear(x, bg_pk, n, k),
                    "bg_onednn": lambda: torch.ops.mkldnn._linear_pointwise(
                        x, bg_dnn, None, "none", [], ""
                    ),
                    "bg_onednn_b": lambda: lin._onednn_bucketed(x, bg_dnn, None, k),
                    "vllm_sgl": lambda: ops.weight_packed_linear_cpu(x, v_sgl, n, None),
                    "vllm_onednn": lambda: ops.onednn_mm(v_dnn, x, None),
                }
                ref = paths["bg_onednn"]()
                diffs = {name: _ulps(fn(), ref) for name, fn in paths.items()}
                times: dict[str, list[float]] = {name: [] for name in paths}
                names = list(paths)
                for r in range(args.rounds):
                    order = names[r % len(names) :] + names[: r % len(names)]
                    gen = torch.Generator().manual_seed(1000 * r + m)
                    counts = (
                        torch.randint(m // 2 + 1, m + 1, (args.calls + 1,), generator=gen)
                        if args.vary
                        else torch.full((args.calls + 1,), m)
                    ).tolist()
                    for name in order:
                        fn = paths[name]
                        x = xs[: counts[-1]]
                        fn()
                        total = 0.0
                        for c in counts[:-1]:
                            x = xs[:c]
                            if args.cold:
                                flush.add_(1.0)
                            t0 = clock()
                            fn()
                            total += clock() - t0
                        times[name].append(total / args.calls * 1e6)
                    x = xs
                med = {name: statistics.median(v) for name, v in times.items()}
                flops = 2 * (0.75 * m if args.vary else m) * n * k  # about, under --vary
                cells = "  ".join(
                    f"{name} {med[name]:8.1f} us {flops / med[name] / 1e3:6.0f} GF/s "
                    f"{med['bg_layer'] / med[name]:4.2f}x d{diffs[name]}"
                    for name in names
                )
                print(f"{label:8s} N {n:4d} K {k} M {m:5d}  {cells}")


if __name__ == "__main__":
    main()
