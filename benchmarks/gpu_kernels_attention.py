"""Decode attention parts of `benchmarks/gpu_kernels.py` (split off to keep each file short):
`paged_attention` on a decode-only batch (GQA), and MLA's absorbed decode on the latent cache
(`bench_mla_decode`, CUDA only), each on the backend the engine picks and on each forced one,
in GB/s of cache read. Also `forced`, the environment override every part uses.
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
    mla_decode_backend,
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


def bench_mla_decode(args, device, dtype, time_fn) -> dict:
    """MLA's absorbed decode attention on the paged latent cache (``--mla-heads`` heads,
    ``--kv-lora-rank`` C, ``--qk-rope-head-dim`` Dr; DeepSeek-V3's layer by default), from the
    absorbed queries to the latent-space context, on the backend `mla_decode_backend` picks,
    then on each of ``--attention-backends`` forced: ``triton`` (the kernel reading the cache
    in place) and ``torch`` (each bucket's latents gathered, then `mla_decode_torch`). GB/s
    counts the latents and rope keys of every context read once, ``seqs * context * (C + Dr)``
    elements (the roofline's bytes). Timed on CUDA only (the Triton kernel runs on CPU only
    under the interpreter): elsewhere the record says ``skipped``."""
    if device.type != "cuda":
        return dict(skipped="timed on CUDA only")
    with forced(ATTENTION_BACKEND_ENV, "auto"):
        backend = mla_decode_backend(device, dtype)
    record = dict(
        num_heads=args.mla_heads,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=args.qk_rope_head_dim,
        block_size=args.block_size,
        path=backend,
        rows=_mla_rows(backend, args, device, dtype, time_fn),
        forced={},
    )
    for name in args.attention_backends:
        try:
            with forced(ATTENTION_BACKEND_ENV, name):
                forced_backend = mla_decode_backend(device, dtype)
            record["forced"][name] = dict(
                rows=_mla_rows(forced_backend, args, device, dtype, time_fn)
            )
        except Exception as exc:  # recorded: an alternative backend, not the engine's
            record["forced"][name] = dict(error=f"{type(exc).__name__}: {exc}")
    return record


def _mla_rows(backend, args, device, dtype, time_fn) -> list[dict]:
    """One timing row per (sequences, context) of the MLA decode on ``backend``."""
    from batchgen.kernels.paged_attention import check_decode_context
    from batchgen.kernels.triton_mla_decode import (
        default_num_kv_splits,
        triton_mla_decode_attention,
    )
    from batchgen.models.layers.mla import mla_decode_torch

    n, c, dr, block = args.mla_heads, args.kv_lora_rank, args.qk_rope_head_dim, args.block_size
    elem = torch.finfo(dtype).bits // 8
    scale = (128 + dr) ** -0.5  # DeepSeek-V3's qk_head_dim (the value does not change speed)
    rows = []
    torch.manual_seed(0)
    for seqs in args.decode_seqs:
        for ctx in args.contexts:
            nb = -(-ctx // block)
            num_blocks = seqs * nb
            tables = torch.randperm(num_blocks, device=device).view(seqs, nb)
            lens = torch.full((seqs,), ctx, device=device)
            bucket = DecodeBucket(0, seqs, tables, lens)
            c_kv = torch.randn(num_blocks * block, c, device=device, dtype=dtype)
            k_pe = torch.randn(num_blocks * block, dr, device=device, dtype=dtype)
            q_lat = torch.randn(seqs, n, c, device=device, dtype=dtype)
            q_pe = torch.randn(seqs, n, dr, device=device, dtype=dtype)
            out = torch.empty_like(q_lat)
            if backend == "triton":
                check_decode_context(tables, lens, block, num_blocks)  # once per step

                def step(q=q_lat, p=q_pe, ck=c_kv, kp=k_pe, b=bucket, o=out):
                    triton_mla_decode_attention(
                        q, p, ck, kp, b.block_tables, b.kv_lens, block, scale, o,
                        context_checked=True,
                    )  # fmt: skip
            else:
                mask = bucket.mask(lens - 1, block, None)

                def step(q=q_lat, p=q_pe, ck=c_kv, kp=k_pe, b=bucket, m=mask):
                    latent, pe = b.gather(ck, block), b.gather(kp, block)
                    mla_decode_torch(q, p, latent, pe, m, scale)

            with torch.inference_mode():
                secs = time_fn(step)
            kv_bytes = seqs * ctx * (c + dr) * elem
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
            if backend == "triton":  # the kernel's own choice, as in the engine
                rows[-1]["num_kv_splits"] = default_num_kv_splits(device, seqs, n, nb * block)
            del c_kv, k_pe
    return rows
