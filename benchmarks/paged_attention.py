"""One layer's decode attention on CPU: the paged decode kernel (`batchgen.kernels.paged_attention`)
in float32 and bfloat16 beside the gathered torch path (block gathers + SDPA, what
``BATCHGEN_CPU_KERNELS=0`` runs), alternating in one process.

    .venv/bin/python benchmarks/paged_attention.py [--seqs 512] [--context 448] [--rounds 8]
        [--context-range 32,1500] [--threads N]
        [--paths kernel_f32,kernel_bf16,torch_bf16,torch_f32,bf16_avx512_bf16,bf16_avx512f,
                 bf16_avx2,bf16_generic,kernel_f32_kvbf16,kernel_f32_kvfp8,kernel_bf16_kvfp8,
                 kernel_f32_kvfp8_e5m2,kernel_bf16_kvfp8_e5m2,kernel_f32_kvfp8_generic]

``--context-range LO,HI`` draws each sequence's context log-uniformly in [LO, HI] (seeded)
instead of ``--context`` for all. ``bf16_<isa>`` forces that bf16 path (`pa.ISAS`).
``kernel_<q>_kv<cache>[_<isa>]`` runs the kernel on a KV cache narrower than q (vLLM's
``kv_cache_dtype``: ``kvbf16``, ``kvfp8`` = float8_e4m3fn, ``kvfp8_e5m2``), called directly (the
new tokens' K/V cast into the cache, then the kernel; the gathered torch path does not read such
a cache), on the same data as the other paths rounded to the cache dtype.
``--clock thread`` times the calling thread's CPU time (``time.thread_time``: meaningful with
``--threads 1``, where the kernel runs in the calling thread, and immune to other processes
taking the core on a loaded machine); ``wall`` (default) times wall-clock. The fastest round
is printed beside the median (on a loaded machine the minimum is the steadier of the two).

Bench-model shapes by default (8 query heads, 2 KV heads of 64, blocks of 16 scattered over the
cache). Each path runs `paged_attention` (the cache write included) on its own cache; the torch
paths bucket the rows as `ModelRunner` does on CPU (`CPU_DECODE_GATHER_BYTES` per gather).
Prints each path's median milliseconds over the rounds, its speed-up over the first path, the
KV bytes it reads per second, and its largest absolute difference from the first path's output.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from batchgen.engine.model_runner import CPU_DECODE_GATHER_BYTES
from batchgen.kernels import paged_attention as pa
from batchgen.models.layers.attention import (
    AttentionMetadata,
    DecodeBucket,
    paged_attention,
    plan_decode_buckets,
)

HQ, HKV, D, BLOCK = 8, 2, 64, 16
# kernel_<q>_kv<cache> paths: the cache dtypes
KV_DTYPES = {
    "kvbf16": torch.bfloat16,
    "kvfp8": torch.float8_e4m3fn,
    "kvfp8_e5m2": torch.float8_e5m2,
}


def _path_dtypes(path: str) -> tuple[torch.dtype, torch.dtype, str]:
    """(q dtype, cache dtype, isa) of a path: ``kernel_f32_kvfp8_generic`` -> (float32,
    float8_e4m3fn, "generic")."""
    if "_kv" in path:
        head, kv = path.split("_kv", 1)
        isa = "auto"
        for name in pa.ISAS:
            if kv.endswith("_" + name):
                kv, isa = kv.removesuffix("_" + name), name
        q_dtype = torch.float32 if head.endswith("f32") else torch.bfloat16
        return q_dtype, KV_DTYPES["kv" + kv], isa
    dtype = torch.float32 if path.endswith("f32") else torch.bfloat16
    isa = path.removeprefix("bf16_") if path.startswith("bf16_") else "auto"
    return dtype, dtype, isa


def _meta(kv_lens, tables, in_place: bool, block_bytes: int) -> AttentionMetadata:
    max_blocks = None if in_place else max(1, CPU_DECODE_GATHER_BYTES // block_bytes)
    nblocks = [len(t) for t in tables]
    spans = (
        [(0, len(tables))]
        if in_place
        else plan_decode_buckets(nblocks, max_bucket_blocks=max_blocks)
    )
    buckets = []
    for start, end in spans:
        width = max(nblocks[start:end])
        rows = [t + [0] * (width - len(t)) for t in tables[start:end]]
        lens = torch.tensor(kv_lens[start:end])
        buckets.append(DecodeBucket(start, end, torch.tensor(rows), lens))
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, kv_lens)]
    return AttentionMetadata(
        positions=torch.tensor([n - 1 for n in kv_lens]),
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(kv_lens),
        decode_buckets=buckets,
        block_size=BLOCK,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--context", type=int, default=448)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--context-range", default=None, help="LO,HI: log-uniform contexts")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    parser.add_argument("--paths", default="kernel_f32,kernel_bf16,torch_bf16")
    args = parser.parse_args()
    paths = args.paths.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.context_range:
        lo, hi = (float(x) for x in args.context_range.split(","))
        u = torch.rand(args.seqs, dtype=torch.float64)
        kv_lens = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))).round().long()
        kv_lens = kv_lens.tolist()
    else:
        kv_lens = [args.context] * args.seqs
    nbs = [-(-n // BLOCK) for n in kv_lens]
    num_blocks = sum(nbs)
    perm = torch.randperm(num_blocks).tolist()
    offsets = [sum(nbs[:i]) for i in range(args.seqs)]
    tables = [perm[o : o + nb] for o, nb in zip(offsets, nbs)]
    k32 = torch.randn(num_blocks * BLOCK, HKV, D)
    v32 = torch.randn(num_blocks * BLOCK, HKV, D)
    q32 = torch.randn(args.seqs, HQ, D)
    new32 = torch.randn(2, args.seqs, HKV, D)
    runs = {}
    for path in paths:
        dtype, cache_dtype, isa = _path_dtypes(path)
        in_place = not path.startswith("torch")
        q = q32.to(dtype)
        k, v, new = (t.to(cache_dtype) for t in (k32, v32, new32))
        meta = _meta(kv_lens, tables, in_place, k[0].numel() * k.element_size() * BLOCK)
        runs[path] = (q, new, (k, v), meta, isa, cache_dtype != dtype)
    print(
        f"{args.seqs} seqs x {sum(kv_lens) / len(kv_lens):.0f} positions on average "
        f"({min(kv_lens)}-{max(kv_lens)}), Hq {HQ}, Hkv {HKV}, D {D}, block {BLOCK}, "
        f"{torch.get_num_threads()} threads; bf16 kernel path: "
        f"{pa.decode_kernel_isa(torch.bfloat16, D)}"
    )

    def run(path):
        q, new, cache, meta, isa, mixed = runs[path]
        os.environ["BATCHGEN_CPU_KERNELS"] = "0" if path.startswith("torch") else "1"
        if isa != "auto" or mixed:  # a forced path or a narrower cache: the kernel directly
            out = torch.empty_like(q)
            for c, x in zip(cache, new):  # as bytes: torch has no index_copy_ for fp8
                c.view(torch.uint8).index_copy_(0, meta.slot_mapping, x.view(torch.uint8))
            b = meta.decode_buckets[0]
            pa.paged_decode_attention(
                q, *cache, b.block_tables, b.kv_lens, BLOCK, D**-0.5, None, out, isa
            )
            return out
        return paged_attention(q, new[0], new[1], cache, meta, D**-0.5)

    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    times = {p: [] for p in paths}
    outs = {p: run(p) for p in paths}  # warm up (builds the kernel)
    for _ in range(args.rounds):
        for p in paths:
            t0 = clock()
            run(p)
            times[p].append(clock() - t0)
    base = statistics.median(times[paths[0]])
    base_min = min(times[paths[0]])
    for p in paths:
        sec = statistics.median(times[p])
        itemsize = runs[p][2][0].element_size()
        gbs = 2 * sum(kv_lens) * HKV * D * itemsize / sec / 1e9
        diff = (outs[p].float() - outs[paths[0]].float()).abs().max().item()
        print(
            f"{p:>16}: {sec * 1e3:7.2f} ms  x{base / sec:5.2f} vs {paths[0]} (fastest round "
            f"{min(times[p]) * 1e3:.2f} ms, x{base_min / min(times[p]):.2f})  {gbs:5.1f} GB/s KV  "
            f"max|diff| {diff:.2e}  (all: {', '.join(f'{t * 1e3:.1f}' for t in times[p])})"
        )


if __name__ == "__main__":
    main()
