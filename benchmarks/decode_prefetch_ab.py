"""A/B of the float32 paged decode kernel's software prefetch (issue 19: perf put about 20% of
the kernel's samples on its prefetch instructions; was the prefetch worth its issue slots?).

    python benchmarks/decode_prefetch_ab.py inorder|random [threads]

Copies the kernel sources (batchgen/kernels/csrc) to a temporary directory, replaces the body
of `prefetch_f32_rows` (csrc/paged_decode_attention_f32.h) by a PFMODE switch and compiles four
variants with the engine's flags (`g++ -O3 -march=native -ffast-math -fopenmp`): 0 as shipped
(every line of every row 32 positions ahead), 1 only the rows at block starts (the rest of a
block left to the hardware prefetcher), 2 none, 3 block starts and middles. Then 512
sequences, contexts log-uniform in 32-1,500, 8 query heads, 2 KV heads of 64, blocks of 16 laid
out in order per sequence (as the engine's FIFO free list hands them out) or shuffled; the
variants alternated in random order per round, 24 rounds, medians of thread CPU time (1
thread) or wall time; the outputs are checked identical. Results: docs/performance.md,
"Decode attention against the block-read ceiling".
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

SRC = Path(__file__).resolve().parent.parent / "batchgen" / "kernels" / "csrc"
SHIPPED = """inline void prefetch_f32_rows(const float* const* rows, int64_t j0, int64_t j1, int64_t row) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t off = 0; off < row; off += 16) _mm_prefetch(rows[j] + off, _MM_HINT_T1);
}"""
SWITCHED = """inline void prefetch_f32_rows(const float* const* rows, int64_t j0, int64_t j1, int64_t row) {
  for (int64_t j = j0; j < j1; ++j) {
    if (PFMODE == 2 || (PFMODE == 1 && (j & 15) != 0) || (PFMODE == 3 && (j & 7) != 0)) continue;
    for (int64_t off = 0; off < row; off += 16) _mm_prefetch(rows[j] + off, _MM_HINT_T1);
  }
}"""


def build_variants(out: Path) -> dict:
    src = out / "src"
    shutil.copytree(SRC, src)
    header = src / "paged_decode_attention_f32.h"
    text = header.read_text()
    assert SHIPPED in text, "prefetch_f32_rows changed: update this benchmark"
    header.write_text(text.replace(SHIPPED, SWITCHED))
    libs = {}
    for m in (0, 1, 2, 3):
        lib = out / f"pf{m}.so"
        subprocess.run(
            ["g++", "-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC",
             "-shared", f"-DPFMODE={m}", str(src / "paged_decode_attention.cpp"), "-o", str(lib)],
            check=True,
        )  # fmt: skip
        libs[m] = str(lib)
    return libs


_TMP = tempfile.TemporaryDirectory(prefix="pfab-")

torch.manual_seed(0)
random.seed(0)
libs = {m: ctypes.CDLL(p) for m, p in build_variants(Path(_TMP.name)).items()}
B, HQ, HKV, D, BS = 512, 8, 2, 64, 16
lens = [int(math.exp(random.uniform(math.log(32), math.log(1500)))) for _ in range(B)]
maxb = max((l + BS - 1) // BS for l in lens)
order = sys.argv[1] if len(sys.argv) > 1 else "inorder"
nblocks_total = sum((l + BS - 1) // BS for l in lens) + 8
ids = list(range(nblocks_total))
if order == "random": random.shuffle(ids)
tables = torch.zeros(B, maxb, dtype=torch.int64); it = iter(ids)
for b, l in enumerate(lens):
    for i in range((l + BS - 1) // BS): tables[b, i] = next(it)
k = torch.randn(nblocks_total * BS, HKV, D); v = torch.randn_like(k)
q = torch.randn(B, HQ, D); kv_lens = torch.tensor(lens, dtype=torch.int64)
outs = {m: torch.empty_like(q) for m in libs}
def call(m, threads):
    f = libs[m].batchgen_paged_decode_attention_f32
    f.restype = ctypes.c_int
    args = [ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(k.data_ptr()), ctypes.c_void_p(v.data_ptr()),
            ctypes.c_void_p(tables.data_ptr()), ctypes.c_void_p(kv_lens.data_ptr()), ctypes.c_void_p(outs[m].data_ptr()),
            ctypes.c_int64(B), ctypes.c_int64(HQ), ctypes.c_int64(HKV), ctypes.c_int64(D), ctypes.c_int64(BS),
            ctypes.c_int64(maxb), ctypes.c_float(D ** -0.5), ctypes.c_int64(0), ctypes.c_int64(threads),
            ctypes.c_int64(0), ctypes.c_int64(HQ * D)]
    assert f(*args) == 0
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
clock = time.thread_time if threads == 1 else time.perf_counter
ts = {m: [] for m in libs}
for r in range(24):
    ms = list(libs); random.shuffle(ms)
    for m in ms:
        t = clock(); call(m, threads); ts[m].append(clock() - t)
for m in libs: assert torch.equal(outs[m], outs[0])
base = st.median(ts[0])
print(order, "threads", threads, {m: f"{st.median(ts[m])*1e3:.2f} ms ({st.median(ts[m])/base:.3f})" for m in libs}, "load", open('/proc/loadavg').read().split()[0])
