"""A/B of the float32 paged decode kernel's software prefetch (issue 19: perf put about 20% of
the kernel's samples on its prefetch instructions; was the prefetch worth its issue slots?).

Builds nothing itself: compile the variants first from a copy of the kernel sources whose
`prefetch_f32_rows` (csrc/paged_decode_attention_f32.h) is switched by a PFMODE macro
(0: as shipped, every line of every row 32 positions ahead; 1: only the rows at block starts,
leaving the rest of a block to the hardware prefetcher; 2: none; 3: block starts and middles):

    g++ -O3 -march=native -ffast-math -fopenmp -std=c++17 -fPIC -shared -DPFMODE=$m \
        src/paged_decode_attention.cpp -o /tmp/pfab/pf$m.so      # m = 0 1 2 3

then `python benchmarks/decode_prefetch_ab.py inorder|random [threads]`: 512 sequences,
contexts log-uniform in 32-1,500, 8 query heads, 2 KV heads of 64, blocks of 16 laid out in
order per sequence (as the engine's FIFO free list hands them out) or shuffled; the variants
alternated in random order per round, 24 rounds, medians of thread CPU time (1 thread) or wall
time; the outputs are checked identical. Results: docs/performance.md, "Decode attention
against the block-read ceiling".
"""
import ctypes, time, random, sys, torch, math
torch.manual_seed(0); random.seed(0)
libs = {m: ctypes.CDLL(f"/tmp/pfab/pf{m}.so") for m in (0, 1, 2, 3)}
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
import statistics as st
base = st.median(ts[0])
print(order, "threads", threads, {m: f"{st.median(ts[m])*1e3:.2f} ms ({st.median(ts[m])/base:.3f})" for m in libs}, "load", open('/proc/loadavg').read().split()[0])
