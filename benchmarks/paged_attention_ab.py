"""The paged decode attention kernel of a git revision against this working tree's, in one
process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/paged_attention_ab.py --base main \\
        [--dtype bfloat16|float32] [--seqs 70,256] [--caches 4] [--rounds 16] [--threads 1] \\
        [--isa auto|amx|avx512_bf16|avx512f|avx2|generic]

Both `csrc/paged_decode_attention.cpp` trees (the revision's, taken with ``git show``, and the
working tree's) are compiled with the flags of `batchgen.kernels.cpu_build` into a temporary
folder and loaded side by side. Bench-model shapes (8 query heads, 2 KV heads of 64, blocks of
16), contexts log-uniform in 32-1,500 (seeded), each of ``--caches`` caches (default 4, the
bench model's layers: the context comes from memory, not from the previous call) a random
permutation of its blocks; both builds read the same caches. Per batch size: the median and
fastest of ``--rounds`` alternated rounds (each 20 calls) in ms per call, timed with the
calling thread's CPU time (`time.thread_time`) with one thread and process CPU time with more
(which counts OpenMP's spinning); ns per (position, KV head); the ratio new / base; the largest
difference of the outputs and whether they are bit-identical.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from batchgen.kernels import paged_attention as pa
from batchgen.kernels.cpu_build import CSRC, CXX_FLAGS, LINK_FLAGS, cxx_command

HQ, HKV, D, BLOCK = 8, 2, 64, 16


def build(src: Path, out: Path) -> ctypes.CDLL:
    """Compile ``src/paged_decode_attention.cpp`` to ``out`` (a .so) and load it, typed."""
    cxx = cxx_command()
    obj = f"{out}.o"
    source = str(src / "paged_decode_attention.cpp")
    subprocess.run([*cxx, *CXX_FLAGS, "-c", source, "-o", obj], check=True)
    subprocess.run([*cxx, obj, "-o", str(out), *LINK_FLAGS], check=True)
    lib = ctypes.CDLL(str(out))
    p, i = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.batchgen_paged_decode_attention_bf16, lib.batchgen_paged_decode_attention_f32):
        fn.argtypes = [p] * 6 + [i] * 6 + [ctypes.c_float, i, i, i, i]
        fn.restype = ctypes.c_int
    return lib


def checkout_csrc(rev: str, dst: Path) -> None:
    """Write the csrc/ files of git revision ``rev`` into ``dst``."""
    root = CSRC.parents[2]
    rel = CSRC.relative_to(root).as_posix()
    names = subprocess.run(
        ["git", "-C", str(root), "ls-tree", "--name-only", f"{rev}:{rel}"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    dst.mkdir(parents=True)
    for name in names:
        blob = subprocess.run(
            ["git", "-C", str(root), "show", f"{rev}:{rel}/{name}"], check=True, capture_output=True
        ).stdout
        (dst / name).write_bytes(blob)


def make_caches(seqs: int, count: int, dtype: torch.dtype, seed: int = 0):
    """Contexts ``[seqs]`` int64 and ``count`` tuples (q, k_cache, v_cache, block_tables)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(seqs, generator=g, dtype=torch.float64)
    lens = torch.exp(math.log(32) + u * (math.log(1500) - math.log(32))).round().long()
    nbs = (lens + BLOCK - 1) // BLOCK
    total = int(nbs.sum())
    caches = []
    for _ in range(count):
        perm = torch.randperm(total, generator=g)
        table = torch.zeros(seqs, int(nbs.max()), dtype=torch.int64)
        offsets = torch.cumsum(nbs, 0) - nbs
        for b, (nb, off) in enumerate(zip(nbs.tolist(), offsets.tolist())):
            table[b, :nb] = perm[off : off + nb]
        k = torch.randn(total * BLOCK, HKV, D, generator=g).to(dtype)
        v = torch.randn(total * BLOCK, HKV, D, generator=g).to(dtype)
        q = torch.randn(seqs, HQ, D, generator=g).to(dtype)
        caches.append((q, k, v, table))
    return lens, caches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main", help="git revision to compare against")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seqs", default="70,256")
    p.add_argument("--caches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--isa", default="auto", choices=sorted(pa.ISAS))
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    entry = "batchgen_paged_decode_attention_" + ("bf16" if dtype == torch.bfloat16 else "f32")
    clock = time.thread_time if args.threads == 1 else time.process_time
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkout_csrc(args.base, tmp / "base")
        libs = {"base": build(tmp / "base", tmp / "base.so"), "new": build(CSRC, tmp / "new.so")}
        for seqs in [int(s) for s in args.seqs.split(",")]:
            lens, caches = make_caches(seqs, args.caches, dtype)
            outs = {n: [torch.empty(seqs, HQ, D, dtype=dtype) for _ in caches] for n in libs}

            def call(name: str, c: int) -> None:
                q, k, v, table = caches[c]
                rc = getattr(libs[name], entry)(
                    q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lens.data_ptr(),
                    outs[name][c].data_ptr(), seqs, HQ, HKV, D, BLOCK, table.shape[1],
                    1.0 / math.sqrt(D), 0, args.threads, pa.ISAS[args.isa], HQ * D,
                )
                if rc != 0:
                    raise RuntimeError(f"{name} build returned {rc}")

            for name in libs:
                for c in range(len(caches)):
                    call(name, c)
            diff = max(
                (outs["base"][c].float() - outs["new"][c].float()).abs().max().item()
                for c in range(len(caches))
            )
            same = all(torch.equal(outs["base"][c], outs["new"][c]) for c in range(len(caches)))
            times: dict[str, list[float]] = {n: [] for n in libs}
            for r in range(args.rounds):
                for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
                    t0 = clock()
                    for i in range(20):
                        call(name, i % len(caches))
                    times[name].append((clock() - t0) / 20 * 1e3)
            units = int(lens.sum()) * HKV
            print(f"B={seqs} {args.dtype} isa {args.isa}, {args.threads} thread(s), ms/call:")
            for name in libs:
                med = statistics.median(times[name])
                print(f"  {name:4s} {med:.3f} (min {min(times[name]):.3f}, "
                      f"{med * 1e6 / units:.1f} ns per position and KV head)")
            ratio = statistics.median(times["new"]) / statistics.median(times["base"])
            ratio_min = min(times["new"]) / min(times["base"])
            print(f"  new/base {ratio:.3f} (min-based {ratio_min:.3f}), max |diff| {diff:.3g}, "
                  f"bit-identical {same}")


if __name__ == "__main__":
    main()
