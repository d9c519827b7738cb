"""The bf16 `PrepackedLinear` layer on the `packed_linear` kernel against its oneDNN path (rows
bucketed, `onednn_bucket_rows`), with a new row count per call as an engine's steps have,
alternated in one process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/packed_linear_vary.py [--threads 2]
        [--rows 16,70,128,256] [--rounds 7] [--calls 20] [--cold]

The bench model's projections (hidden 512: qkv 768 x 512, o 512 x 512, router 64 x 512,
lm_head 512 x 512). Per ``M`` of ``--rows``: ``--rounds`` rounds, each of ``--calls`` calls
with row counts drawn from ``(M/2, M]`` (a seed per round, the same counts for both paths),
the two paths in alternating order; the multiply-add limits of `use_packed_linear` are lifted
(``packed``) or zeroed (``onednn``) so that the layer runs one path at every row count. Prints
the median per-call process CPU time (``time.process_time``: all threads, not inflated by
other jobs' time slices; set ``OMP_WAIT_POLICY=PASSIVE`` so that idle OpenMP threads do not
spin) and oneDNN's time over the kernel's. ``--cold`` writes a 64 MiB buffer before each call
(untimed), as the expert GEMMs between two projections evict the caches. Runs under
``torch.inference_mode`` as the engine does; needs a CPU with avx512_bf16.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch import nn

from batchgen.kernels import packed_linear as pk
from batchgen.models.layers import linear as lin

SHAPES = [("qkv", 768, 512), ("o", 512, 512), ("router", 64, 512), ("lm_head", 512, 512)]
LIMITS = ("PACKED_LINEAR_MAX_MACS_ONE_THREAD", "PACKED_LINEAR_MAX_MACS",
          "PACKED_LINEAR_MAX_MACS_VNNI", "PACKED_LINEAR_MAX_MACS_NO_AMX_CPU")  # fmt: skip


def _force(path: str, saved: dict[str, int]) -> None:
    """Make `use_packed_linear` pick ``path`` at every row count (``None``: restore)."""
    for name in LIMITS:
        value = saved[name] if path is None else (2**62 if path == "packed" else 0)
        setattr(lin, name, value)
    lin.PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT = (
        saved["PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT"] if path in (None, "packed") else 0
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="16,70,128,256", help="M values: rows drawn from (M/2, M]")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--cold", action="store_true", help="evict the caches before each call")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not pk.packed_linear_supported():
        raise SystemExit("the packed_linear kernel is not available here (avx512_bf16?)")
    saved = {name: getattr(lin, name) for name in LIMITS}
    saved["PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT"] = lin.PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT
    buf = torch.empty(64 << 20, dtype=torch.uint8)
    print(f"packed_linear isa {pk.kernel_isa()}, threads {args.threads}, cold {args.cold}")
    with torch.inference_mode():
        for label, n, k in SHAPES:
            holder = nn.Sequential(nn.Linear(k, n, bias=False).bfloat16())
            lin.enable_prepacked_linear(holder)
            layer = holder[0]
            for m_max in [int(v) for v in args.rows.split(",")]:
                times: dict[str, list[float]] = {"packed": [], "onednn": []}
                for r in range(args.rounds):
                    rng = random.Random(r)
                    xs = [
                        torch.randn(rng.randint(m_max // 2 + 1, m_max), k).bfloat16()
                        for _ in range(args.calls)
                    ]
                    for path in ("packed", "onednn") if r % 2 == 0 else ("onednn", "packed"):
                        _force(path, saved)
                        total = 0.0
                        for x in xs:
                            if args.cold:
                                buf.add_(1)
                            t0 = time.process_time()
                            layer(x)
                            total += time.process_time() - t0
                        times[path].append(total / len(xs) * 1e6)
                _force(None, saved)
                pt, ot = statistics.median(times["packed"]), statistics.median(times["onednn"])
                print(
                    f"{label:8s} N {n:4d} K {k:4d} rows in ({m_max // 2}, {m_max}]  packed "
                    f"{pt:8.1f} us  onednn {ot:8.1f} us  onednn/packed {ot / pt:4.2f}x"
                )


if __name__ == "__main__":
    main()
