"""The fused MoE kernel of a git revision against this working tree's, in one process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fused_moe_ab.py --base main \\
        [--dtype bfloat16|float32] [--tokens 16,70,128,512,2048] [--rounds 9] \\
        [--isa amx|avx512_bf16|auto|avx2] [--threads 1,2]

Both `csrc/fused_moe.cpp` trees (the revision's, taken with ``git show``, and the working
tree's) are compiled with the flags of `batchgen.kernels.cpu_build` into a temporary folder and
loaded side by side; each call gets the same weights, routing and workspace. Bench layer by
default (E 64, top-8, H 512, I 256, random softmax routing). Per token count and thread count:
the fastest of ``--rounds`` alternated rounds (each a loop of calls) in ms per call, one thread
timed with process CPU time (`time.process_time`, less sensitive to other jobs), more threads
with wall time; the ratio new / base; the largest difference of the outputs (0 when the
change keeps every sum); whether the new build gives the same bits on 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from batchgen.kernels import fused_moe as fm
from batchgen.kernels.cpu_build import CSRC, CXX_FLAGS, LINK_FLAGS, cxx_command
from batchgen.models.layers.moe import sort_by_expert


def build(src: Path, out: Path) -> ctypes.CDLL:
    """Compile ``src/fused_moe.cpp`` to ``out`` (a .so) and load it, its entries typed."""
    cxx = cxx_command()
    obj = f"{out}.o"
    subprocess.run([*cxx, *CXX_FLAGS, "-c", str(src / "fused_moe.cpp"), "-o", obj], check=True)
    subprocess.run([*cxx, obj, "-o", str(out), *LINK_FLAGS], check=True)
    lib = ctypes.CDLL(str(out))
    for fn in (lib.batchgen_fused_moe_silu_bf16, lib.batchgen_fused_moe_silu_f32):
        fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7
    return lib


def checkout_csrc(rev: str, dst: Path) -> None:
    """Write the csrc/ files of git revision ``rev`` into ``dst``."""
    root = CSRC.parents[2]
    rel = CSRC.relative_to(root).as_posix()
    names = subprocess.run(
        ["git", "-C", str(root), "ls-tree", "--name-only", f"{rev}:{rel}"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    for name in names:
        blob = subprocess.run(
            ["git", "-C", str(root), "show", f"{rev}:{rel}/{name}"], check=True, capture_output=True
        ).stdout
        (dst / name).write_bytes(blob)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="main", help="git revision to compare against")
    p.add_argument("--tokens", default="16,70,128,512,2048")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--isa", default=None, help="bfloat16: amx (default) or avx512_bf16; float32: auto or avx2"
    )
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    args = p.parse_args()
    e, a, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    dtype = getattr(torch, args.dtype)
    isa_name = args.isa or ("amx" if dtype == torch.bfloat16 else "auto")
    if isa_name not in fm.ISAS[dtype]:
        raise SystemExit(f"--isa must be one of {sorted(fm.ISAS[dtype])} for {args.dtype}")
    isa = fm.ISAS[dtype][isa_name]
    entry = "batchgen_fused_moe_silu_" + ("bf16" if dtype == torch.bfloat16 else "f32")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "base").mkdir()
        checkout_csrc(args.base, tmp / "base")
        libs = {"base": build(tmp / "base", tmp / "base.so"), "new": build(CSRC, tmp / "new.so")}
        torch.manual_seed(0)
        w13 = fm.pack_expert_weights((torch.randn(e, 2 * i, h) * 0.02).to(dtype))
        w2 = fm.pack_expert_weights((torch.randn(e, h, i) * 0.02).to(dtype))
        print(
            f"E {e} top-{a} H {h} I {i}, {args.dtype} isa {isa_name}, base {args.base} vs "
            "working tree"
        )
        for t in (int(x) for x in args.tokens.split(",")):
            x = torch.randn(t, h).to(dtype)
            weights, ids = torch.topk(torch.randn(t, e).softmax(-1), a, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).float().contiguous()
            order, counts = sort_by_expert(ids, e)
            order = order.contiguous()
            starts = torch.zeros(e + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor(counts), 0, out=starts[1:])
            y_slots = torch.empty(t * a * h)
            outs = {name: torch.empty(t, h) for name in libs}

            def call(name: str, threads: int, out: torch.Tensor) -> None:
                rc = getattr(libs[name], entry)(
                    x.data_ptr(), w13.data_ptr(), w2.data_ptr(), weights.data_ptr(),
                    order.data_ptr(), starts.data_ptr(), y_slots.data_ptr(), out.data_ptr(),
                    t, h, i, a, e, threads, isa,
                )
                if rc != 0:
                    raise RuntimeError(f"{name} kernel returned {rc}")

            for name in libs:
                call(name, 1, outs[name])
            two = torch.empty(t, h)
            call("new", 2, two)
            line = f"T={t:5d}"
            calls = max(3, 800 // t)
            for threads in (int(n) for n in args.threads.split(",")):
                clock = time.process_time if threads == 1 else time.perf_counter
                best = {name: float("inf") for name in libs}
                for r in range(args.rounds):
                    for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
                        t0 = clock()
                        for _ in range(calls):
                            call(name, threads, outs[name])
                        best[name] = min(best[name], (clock() - t0) / calls * 1e3)
                kind = "cpu" if threads == 1 else "wall"
                line += (
                    f" | {threads}t {kind}: base {best['base']:.3f} new {best['new']:.3f} ms, "
                    f"new/base {best['new'] / best['base']:.2f}"
                )
            diff = (outs["new"] - outs["base"]).abs().max().item()
            same = torch.equal(two, outs["new"])
            print(f"{line} | max|diff| {diff:.1e}, 1t == 2t {same}", flush=True)


if __name__ == "__main__":
    main()
