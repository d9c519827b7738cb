"""A/B of the bf16 paged decode kernel's vdpbf16ps path (issue 19: where does its time go, and
does a K block transposed once for a KV head's G query heads beat a reduction tree per head?).

    python benchmarks/decode_scores_ab.py [inorder|random] [threads] [rounds]

Copies the kernel sources (batchgen/kernels/csrc) to a temporary directory and compiles, with
the engine's flags (`g++ -O3 -march=native -ffast-math -fopenmp`):

- ``shipped``: the kernel as it is;
- ``transposed``: `patches/decode_bf16_transposed_scores.patch` applied: the scores of up to 4
  query heads from one pass over the K rows, 4 rows transposed 4 x 4 within 128-bit lanes
  (per 16 rows and 32 dimensions: 16 loads and 32 shuffles shared by the heads, instead of
  16 loads and 45 shuffles and adds per head); P @ V and the softmax unchanged;
- ``no_scores`` and ``no_pv``: the shipped kernel with its scores (and so every read of the K
  rows) or its P @ V left out: wrong outputs, timing only, to see what each stage costs.

Then 512 sequences, contexts log-uniform in 32-1,500, 8 query heads, 2 KV heads of 64, blocks
of 16 laid out in order per sequence (as the engine's FIFO free list hands them out) or
shuffled, bf16 q/K/V, the path forced to AVX512-BF16 (isa 4: the AMX path, auto's choice on
AMX machines, is not this code). The variants alternate in random order per round; medians of
thread CPU time (1 thread) or wall time. ``transposed``'s output is compared with
``shipped``'s (another summation order: a few bf16 ulps). Needs a CPU with avx512_bf16 and
`patch`. Results: docs/performance.md, "The decode roofline".
"""

import ctypes
import math
import random
import shutil
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "batchgen" / "kernels" / "csrc"
PATCH = HERE / "patches" / "decode_bf16_transposed_scores.patch"
# Stage switches put into the shipped source (BG_SKIP 1: no scores, 2: no P @ V).
SKIPS = [
    ("        scores_bf16(q + h * d,", "        if (BG_SKIP != 1) scores_bf16(q + h * d,"),
    ("    for (int64_t h = 0; h < g; h += 4) {\n      const bf16_t* w = s.weights",
     "    if (BG_SKIP != 2) for (int64_t h = 0; h < g; h += 4) {\n      const bf16_t* w = s.weights"),
]  # fmt: skip


def _compile(src: Path, lib: Path, defines: list[str]) -> str:
    cmd = ["g++", "-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC",
           "-shared", *defines, str(src / "paged_decode_attention.cpp"), "-o", str(lib)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return str(lib)


def build_variants(out: Path) -> dict[str, str]:
    """Compile the four variants into ``out``; returns name -> shared library path."""
    shipped, patched = out / "shipped", out / "patched"
    shutil.copytree(SRC, shipped)
    shutil.copytree(SRC, patched)
    subprocess.run(["patch", "-s", "-p4", "-d", str(patched), "-i", str(PATCH)], check=True)
    header = shipped / "paged_decode_attention_bf16.h"
    text = header.read_text()
    for old, new in SKIPS:
        assert text.count(old) == 1, "paged_decode_attention_bf16.h changed: update this benchmark"
        text = text.replace(old, new)
    header.write_text(text)
    return {
        "shipped": _compile(shipped, out / "shipped.so", ["-DBG_SKIP=0"]),
        "transposed": _compile(patched, out / "transposed.so", []),
        "no_scores": _compile(shipped, out / "no_scores.so", ["-DBG_SKIP=1"]),
        "no_pv": _compile(shipped, out / "no_pv.so", ["-DBG_SKIP=2"]),
    }


def main() -> None:
    order = sys.argv[1] if len(sys.argv) > 1 else "inorder"
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    tmp = tempfile.TemporaryDirectory(prefix="scoresab-")
    libs = {m: ctypes.CDLL(p) for m, p in build_variants(Path(tmp.name)).items()}
    torch.manual_seed(0)
    random.seed(0)
    b, hq, hkv, d, bs = 512, 8, 2, 64, 16
    lens = [int(math.exp(random.uniform(math.log(32), math.log(1500)))) for _ in range(b)]
    maxb = max((n + bs - 1) // bs for n in lens)
    total = sum((n + bs - 1) // bs for n in lens) + 8
    ids = list(range(total))
    if order == "random":
        random.shuffle(ids)
    tables = torch.zeros(b, maxb, dtype=torch.int64)
    it = iter(ids)
    for i, n in enumerate(lens):
        for j in range((n + bs - 1) // bs):
            tables[i, j] = next(it)
    k = torch.randn(total * bs, hkv, d).bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(b, hq, d).bfloat16()
    kv_lens = torch.tensor(lens, dtype=torch.int64)
    outs = {m: torch.empty_like(q) for m in libs}

    def call(m: str) -> None:
        f = libs[m].batchgen_paged_decode_attention_bf16
        f.restype = ctypes.c_int
        ptrs = [q, k, v, tables, kv_lens, outs[m]]
        args = [ctypes.c_void_p(t.data_ptr()) for t in ptrs]
        args += [ctypes.c_int64(x) for x in (b, hq, hkv, d, bs, maxb)]
        args += [ctypes.c_float(d**-0.5), ctypes.c_int64(0), ctypes.c_int64(threads)]
        args += [ctypes.c_int64(4), ctypes.c_int64(hq * d)]  # isa 4: AVX512-BF16
        assert f(*args) == 0, "the kernel refused the call (no avx512_bf16 on this CPU?)"

    clock = time.thread_time if threads == 1 else time.perf_counter
    ts: dict[str, list[float]] = {m: [] for m in libs}
    for _ in range(rounds):
        names = list(libs)
        random.shuffle(names)
        for m in names:
            t = clock()
            call(m)
            ts[m].append(clock() - t)
    diff = (outs["transposed"].float() - outs["shipped"].float()).abs().max().item()
    base = st.median(ts["shipped"])
    load = open("/proc/loadavg").read().split()[0]
    print(f"{order}, {threads} thread(s), {rounds} rounds, load average {load}")
    for m in libs:
        print(f"  {m:>10}: {st.median(ts[m]) * 1e3:7.2f} ms ({st.median(ts[m]) / base:.3f})")
    print(f"  transposed vs shipped: max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
