"""Decode attention part of `benchmarks/gpu_kernels.py` (split off to keep each file short):
`paged_attention` on a decode-only batch, on the backend the engine picks and on each forced
one, in GB/s of K/V read. Also `forced`, the environment override both parts use.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from batchgen.engine.model_runner import CPU_DECODE_GATHER_BYTES
from batchgen.models.layers.attention import (
    AttentionMetadata,
    DecodeBucket,
    paged_attention,
    plan_decode_buckets,
)
from batchgen.models.layers.attention_backend import (
    ATTENTION_BACKEND_ENV,
    decode_attention_backend,
)

@contextmanager
def forced(name: str, value: str | None):
    """``os.environ[name] = value`` inside the block (unchanged when ``value`` is None)."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _decode_meta(kv_lens, tables, block, device, in_place, block_bytes) -> AttentionMetadata:
    """Decode-only `AttentionMetadata` built as `ModelRunner.prepare` builds it on ``device``."""
    nblocks = [len(t) for t in tables]
    if in_place:
        plan = [(0, len(tables))]
    else:
        cpu_cap = max(1, CPU_DECODE_GATHER_BYTES // block_bytes)
        cap = cpu_cap if device.type == "cpu" else None
        plan = plan_decode_buckets(nblocks, max_bucket_blocks=cap)
    buckets = []
    for start, end in plan:
        width = max(nblocks[start:end])
        rows = [t + [0] * (width - len(t)) for t in tables[start:end]]
        lens = torch.tensor(kv_lens[start:end], device=device)
        buckets.append(DecodeBucket(start, end, torch.tensor(rows, device=device), lens))
    slots = [t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, kv_lens)]
    return AttentionMetadata(
        positions=torch.tensor([n - 1 for n in kv_lens], device=device),
        slot_mapping=torch.tensor(slots, device=device),
        num_decode_tokens=len(kv_lens),
        decode_buckets=buckets,
        block_size=block,
    )


def bench_decode_attention(args, device, dtype, time_fn) -> dict:
    """`paged_attention` on a decode-only batch (the cache write included), blocks scattered
    over the cache, on the backend the engine picks, then on each of
    ``--attention-backends`` forced; GB/s counts the K and V of every context read once (the
    roofline's bytes), whatever the path copies on the way."""
    with forced(ATTENTION_BACKEND_ENV, "auto"):
        backend, rows = _attention_rows(args, device, dtype, time_fn)
    record = dict(
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        path=backend,
        rows=rows,
        forced={},
    )
    for name in args.attention_backends:
        try:
            with forced(ATTENTION_BACKEND_ENV, name):
                _, rows = _attention_rows(args, device, dtype, time_fn)
            record["forced"][name] = dict(rows=rows)
        except Exception as exc:  # recorded: an alternative backend, not the engine's
            record["forced"][name] = dict(error=f"{type(exc).__name__}: {exc}")
    return record


def _attention_rows(args, device, dtype, time_fn) -> tuple[str, list[dict]]:
    """``(the decode backend taken, one timing row per (sequences, context))``."""
    hq, hkv, d, block = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    elem = torch.finfo(dtype).bits // 8
    backend = decode_attention_backend(device, dtype)
    in_place = backend != "torch"
    rows = []
    torch.manual_seed(0)
    for seqs in args.decode_seqs:
        for ctx in args.contexts:
            nb = -(-ctx // block)
            num_blocks = seqs * nb
            perm = torch.randperm(num_blocks).tolist()
            tables = [perm[i * nb : (i + 1) * nb] for i in range(seqs)]
            k_cache = torch.randn(num_blocks * block, hkv, d, device=device, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            q = torch.randn(seqs, hq, d, device=device, dtype=dtype)
            k_new, v_new = torch.randn(2, seqs, hkv, d, device=device, dtype=dtype)
            block_bytes = block * hkv * d * elem
            meta = _decode_meta([ctx] * seqs, tables, block, device, in_place, block_bytes)

            def step(q=q, k=k_new, v=v_new, kc=k_cache, vc=v_cache, meta=meta):
                paged_attention(q, k, v, (kc, vc), meta, d**-0.5)

            with torch.inference_mode():
                secs = time_fn(step)
            kv_bytes = 2 * seqs * ctx * hkv * d * elem
            gbs = kv_bytes / secs / 1e9
            rows.append(
                dict(
                    seqs=seqs,
                    context=ctx,
                    ms=secs * 1e3,
                    kv_bytes=kv_bytes,
                    gbs=gbs,
                    share_of_hbm=gbs / args.peak_hbm_gbs,
                )
            )
            del k_cache, v_cache
    return backend, rows
