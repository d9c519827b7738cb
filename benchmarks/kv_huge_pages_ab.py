"""The paged decode kernel on a KV cache backed by transparent huge pages (as `ModelRunner`
allocates it on CPU, `host_allocator.empty_huge_pages`) against one on 4 KiB pages, alternated
in one process; and what each cache's first touch (allocation and zeroing) costs.

    python benchmarks/kv_huge_pages_ab.py bf16|f32 random|inorder [threads]

A 3 GiB cache of each kind; 512 sequences of 32-1,500 positions (log-uniform, seeded), 8 query
heads, 2 KV heads of 64, blocks of 16 scattered at random over the whole cache (a long job's
churned free list) or in order from block 0 (a fresh cache); 16 rounds, medians of wall time;
the outputs are checked identical. Results: docs/performance.md (the CPU KV cache's huge pages).
"""
import math, random, statistics as st, sys, time, torch
from batchgen.kernels import paged_attention as pa
from batchgen.engine.host_allocator import empty_huge_pages
torch.manual_seed(0); random.seed(0)
dtype = torch.bfloat16 if sys.argv[1] == "bf16" else torch.float32
order = sys.argv[2]
B, HQ, HKV, D, BS = 512, 8, 2, 64, 16
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
lens = [int(math.exp(random.uniform(math.log(32), math.log(1500)))) for _ in range(B)]
maxb = max((n + BS - 1) // BS for n in lens)
# a big cache (3 GiB of blocks) with this job's blocks spread over it, as in a long job
total = (3 << 30) // (BS * HKV * D * 2 * 2 if dtype == torch.bfloat16 else BS * HKV * D * 4 * 2)
need = sum((n + BS - 1) // BS for n in lens)
ids = random.sample(range(total), need) if order == "random" else list(range(need))
tables = torch.zeros(B, maxb, dtype=torch.int64); it = iter(ids)
for i, n in enumerate(lens):
    for j in range((n + BS - 1) // BS): tables[i, j] = next(it)
caches = {}
for name in ("huge", "small"):
    t0 = time.perf_counter()
    if name == "huge":
        k = empty_huge_pages((total * BS, HKV, D), dtype); v = empty_huge_pages((total * BS, HKV, D), dtype)
    else:
        k = torch.empty(total * BS, HKV, D, dtype=dtype); v = torch.empty_like(k)
    k.zero_(); v.zero_()
    print(name, "alloc+zero", round(time.perf_counter() - t0, 1), "s", flush=True)
    caches[name] = (k, v)
rows = torch.cat([torch.arange(b * BS, b * BS + BS) for b in ids])
src = torch.randn(len(rows), HKV, D).to(dtype)
for k, v in caches.values():
    k[rows] = src; v[rows] = src
q = torch.randn(B, HQ, D).to(dtype); kv = torch.tensor(lens, dtype=torch.int64)
outs = {n: torch.empty_like(q) for n in caches}
ts = {n: [] for n in caches}
for r in range(16):
    for n in random.sample(list(caches), 2):
        k, v = caches[n]
        t = time.perf_counter()
        pa.paged_decode_attention(q, k, v, tables, kv, BS, D ** -0.5, None, outs[n])
        ts[n].append(time.perf_counter() - t)
assert torch.equal(outs["huge"], outs["small"])
b = st.median(ts["small"])
print(sys.argv[1:], {n: f"{st.median(ts[n])*1e3:.2f} ms ({st.median(ts[n])/b:.3f})" for n in ts}, open('/proc/loadavg').read().split()[0])
