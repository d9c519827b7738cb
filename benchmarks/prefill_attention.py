"""One layer's prefill attention on CPU: the flash-attention kernel
(`batchgen.kernels.prefill_attention`) beside torch's SDPA per chunk (what
``BATCHGEN_PREFILL_ATTENTION=sdpa`` runs: a first chunk causal on its new K/V, a later chunk
``index_select``s its cached context and masks it), alternating in one process.

    .venv/bin/python benchmarks/prefill_attention.py [--chunks 512,2048] [--contexts 0,1024]
        [--dtypes bfloat16,float32] [--rounds 7] [--threads 1] [--spans N] [--head-size 64]
        [--kv-cache-dtypes auto,bfloat16,fp8,fp8_e5m2]

Each case is one prefill span of ``chunk`` new tokens after ``context`` cached ones, bench-model
shapes (8 query heads, 2 KV heads of 64 or ``--head-size``, blocks of 16 shuffled over the
cache), through `paged_attention` (cache write included). The metadata is built once per case
and reused by every round, as the layers of one step share it (the SDPA path's mask and the
kernel's plan are built in the first round, outside the timing). ``--spans N`` adds a step of N
first chunks of 32-1,024 tokens (log-uniform, seeded: the rollouts workload's prompts) in one
call. Times are process CPU time (``time.process_time``: with ``--threads 1`` immune to other
processes taking the core; with more threads it counts OpenMP's spinning too); prints the median
and fastest of the rounds, the speed-up of the kernel, and the largest difference.

``--kv-cache-dtypes`` (vLLM's names; default ``auto``, the model's dtype) adds, per narrower
cache (float32: bfloat16, fp8, fp8_e5m2; bf16: the fp8 formats), the same spans on that cache
(its values the rounded ones of the same data): SDPA (on the dequantised context, what
``sdpa`` runs), the kernel reading the narrow cache, and the kernel on the cache of q's dtype
("same"), the three alternating in one process.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time

import torch

from batchgen.models.layers.attention import AttentionMetadata, PrefillSpan, paged_attention
from batchgen.models.layers.kv_cache_dtype import quantize_kv, resolve_kv_cache_dtype

HQ, HKV, D, BLOCK = 8, 2, 64, 16


def _case(chunks: list[int], context: int, dtype: torch.dtype, seed: int = 0, d: int = D):
    """One step: a span per entry of ``chunks``, each after ``context`` cached tokens."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-(n + context) // BLOCK) for n in chunks]
    nblocks = sum(per_seq) + 8
    table = torch.randperm(nblocks, generator=g)
    kc = torch.randn(nblocks * BLOCK, HKV, d, generator=g).to(dtype)
    vc = torch.randn(nblocks * BLOCK, HKV, d, generator=g).to(dtype)
    total = sum(chunks)
    q = torch.randn(total, HQ, d, generator=g).to(dtype)
    k = torch.randn(total, HKV, d, generator=g).to(dtype)
    v = torch.randn(total, HKV, d, generator=g).to(dtype)
    spans, positions, slot_mapping, start, used = [], [], [], 0, 0
    for n, nb in zip(chunks, per_seq):
        pos = torch.arange(n + context)
        slots = table[used : used + nb][pos // BLOCK] * BLOCK + pos % BLOCK
        used += nb
        spans.append(PrefillSpan(start, n, n + context, slots))
        positions.append(pos[context:])
        slot_mapping.append(slots[context:])
        start += n
    meta = AttentionMetadata(
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slot_mapping),
        block_size=BLOCK,
        prefills=spans,
    )
    return q, k, v, (kc, vc), meta


def _time_modes(runs: dict, rounds: int) -> tuple[dict, dict, dict]:
    """``runs``: name -> (mode, thunk). Every round runs each once, the order rotated; round 0
    warms up (builds the mask / plan). Returns the outputs and median / min times (ms)."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    outs = {}
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            mode, thunk = runs[name]
            os.environ["BATCHGEN_PREFILL_ATTENTION"] = mode
            t0 = time.process_time()
            outs[name] = thunk()
            if r:
                times[name].append(time.process_time() - t0)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    low = {n: min(t) * 1e3 for n, t in times.items()}
    return outs, med, low


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="512,2048")
    ap.add_argument("--contexts", default="0,1024")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spans", type=int, default=0)
    ap.add_argument("--head-size", type=int, default=D)
    ap.add_argument("--kv-cache-dtypes", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"threads {args.threads}, head size {args.head_size}, process CPU time, median (min) ms "
        f"over {args.rounds} rounds, load average {os.getloadavg()[0]:.2f}"
    )
    scale = args.head_size**-0.5
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        contexts = [int(c) for c in args.contexts.split(",")]
        cases = [([int(c)], ctx) for c in args.chunks.split(",") for ctx in contexts]
        if args.spans:
            rng = random.Random(0)
            logs = [rng.uniform(math.log(32), math.log(1024)) for _ in range(args.spans)]
            cases.append(([int(math.exp(x)) for x in logs], 0))
        for chunks, context in cases:
            chunk = sum(chunks)
            q, k, v, cache, meta = _case(chunks, context, dtype, d=args.head_size)
            head = (
                f"{dtype_name:8s} {len(chunks):2d} span(s) of {chunk:5d} tokens, context "
                f"{context:5d}"
            )
            for kv_name in args.kv_cache_dtypes.split(","):
                cache_dtype = resolve_kv_cache_dtype(kv_name, dtype)
                if kv_name != "auto" and cache_dtype == dtype:
                    continue  # not narrower than q: the same as auto
                if cache_dtype == dtype:
                    runs = {
                        m: (m, lambda: paged_attention(q, k, v, cache, meta, scale))
                        for m in ("sdpa", "kernel")
                    }
                    outs, med, low = _time_modes(runs, args.rounds)
                    diff = (outs["kernel"].double() - outs["sdpa"].double()).abs().max().item()
                    print(
                        f"{head}: sdpa {med['sdpa']:8.2f} ({low['sdpa']:7.2f})  kernel "
                        f"{med['kernel']:8.2f} ({low['kernel']:7.2f})  speed-up "
                        f"{med['sdpa'] / med['kernel']:5.2f}x  max diff {diff:.2e}"
                    )
                    continue
                narrow = tuple(quantize_kv(c, cache_dtype) for c in cache)
                runs = {
                    "sdpa": ("sdpa", lambda: paged_attention(q, k, v, narrow, meta, scale)),
                    "kernel": ("kernel", lambda: paged_attention(q, k, v, narrow, meta, scale)),
                    "same": ("kernel", lambda: paged_attention(q, k, v, cache, meta, scale)),
                }
                outs, med, low = _time_modes(runs, args.rounds)
                diff = (outs["kernel"].double() - outs["sdpa"].double()).abs().max().item()
                print(
                    f"{head}, {kv_name:8s} cache: sdpa {med['sdpa']:8.2f} ({low['sdpa']:7.2f})  "
                    f"kernel {med['kernel']:8.2f} ({low['kernel']:7.2f})  same-dtype kernel "
                    f"{med['same']:8.2f}  speed-up {med['sdpa'] / med['kernel']:5.2f}x  "
                    f"kernel/same {med['kernel'] / med['same']:5.2f}  max diff {diff:.2e}"
                )
    os.environ.pop("BATCHGEN_PREFILL_ATTENTION", None)


if __name__ == "__main__":
    main()
