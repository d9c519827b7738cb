"""vLLM's CPU decode attention against BatchGen's, alone, in one process: same q, K, V, contexts.

    PYTHONPATH=$PWD benchmarks/peers/.venv-vllm/bin/python benchmarks/peers/decode_attention.py \\
        --seqs 70,256 --threads 1,2

Runs in vLLM's venv (its ``torch.ops._C`` kernels) with this repository on ``PYTHONPATH``
(BatchGen's kernel is a C++ library it builds on first use). One decode token per sequence,
contexts drawn log-uniformly in ``--context-range`` (seeded), the bench model's heads (8 query
heads, 2 KV heads of 64), bfloat16 (or ``--dtype float32``). The same K/V values go into each
engine's own cache:

- vLLM: what `CPUAttentionBackendImpl` runs: a ``[num_blocks, Hkv, block_size, 2 D]`` cache
  (blocks of ``--vllm-block-size``, 128 by default as vLLM's CPU platform sets it) split into
  key and value views, written by ``cpu_attn_reshape_and_cache`` (which stores them in its own
  packed layout for the isa), the per-step ``cpu_attn_get_scheduler_metadata`` (isa ``amx``
  for bf16 where ``torch.cpu._is_amx_tile_supported()``, else ``vec``; KV split on, vLLM's
  default ``VLLM_CPU_ATTN_SPLIT_KV=1``), then ``cpu_attention_with_kv_cache``.
- BatchGen: `paged_decode_attention` on its ``[num_slots, Hkv, D]`` caches (blocks of
  ``--block-size``, 16 by default: `EngineConfig.block_size`; allocated as `ModelRunner` does,
  on transparent huge pages where Linux gives them) with ``context_checked=True``, as
  `paged_attention` calls it per layer (the context check runs once per step).

Each engine's blocks are a random permutation of its cache. ``--caches N`` (default 4, the
bench model's layers) gives each engine N caches, cycled call by call, so that as in a step
over the layers the context is not already in L1/L2 from the previous call. The per-step
metadata (vLLM's scheduler metadata, BatchGen's `check_decode_context`) is timed separately.

Timing: rounds alternate which engine goes first; each round a loop of calls. ``--clock
thread`` (``time.thread_time``, the default with one thread) or ``process``
(``time.process_time``: CPU time of all threads, the default with more) are immune to other
processes taking the cores of a loaded machine; ``wall`` is wall-clock. Prints medians in ms
per call, the ratio, and the largest difference between the two outputs and to a float32
reference (gathered context, float32 softmax).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

HQ, HKV, D = 8, 2, 64


def _contexts(n: int, lo: float, hi: float, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))).round().long().tolist()


def _tables(lens: list[int], block: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables [B, max_blocks] int64 over a randomly permuted cache, and its block count."""
    nbs = [-(-n // block) for n in lens]
    total = sum(nbs)
    perm = torch.randperm(total, generator=g)
    width = max(nbs)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    o = 0
    for i, nb in enumerate(nbs):
        table[i, :nb] = perm[o : o + nb]
        o += nb
    return table, total


def _slots(lens: list[int], table: torch.Tensor, block: int) -> torch.Tensor:
    """Slot of every position of every sequence, sequence-major: [sum(lens)] int64."""
    out = []
    for i, n in enumerate(lens):
        p = torch.arange(n)
        out.append(table[i, p // block] * block + p % block)
    return torch.cat(out)


def _reference(q, ks, vs, lens, scale) -> torch.Tensor:
    """float32 attention of q [B, Hq, D] over each sequence's keys/values [n, Hkv, D]."""
    out = torch.empty(q.shape, dtype=torch.float32)
    g = HQ // HKV
    for i, n in enumerate(lens):
        k = ks[i].float().repeat_interleave(g, 1)  # [n, Hq, D]
        v = vs[i].float().repeat_interleave(g, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="70,256", help="comma-separated batch sizes")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--context-range", default="32,1500", help="LO,HI: log-uniform contexts")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=40, help="calls per round and engine")
    p.add_argument("--caches", type=int, default=4, help="caches cycled per engine (layers)")
    p.add_argument("--block-size", type=int, default=16, help="BatchGen's block size")
    p.add_argument("--vllm-block-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--clock", default=None, choices=["thread", "process", "wall"])
    p.add_argument("--isa", default=None, help="BatchGen's bf16 path (pa.ISAS); default auto")
    p.add_argument("--engines", default="vllm,batchgen")
    args = p.parse_args()
    import vllm._custom_ops as ops

    from batchgen.engine.model_runner import _new_cache
    from batchgen.kernels import paged_attention as pa

    dtype = getattr(torch, args.dtype)
    vllm_isa = (
        "amx" if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() else "vec"
    )
    lo, hi = (float(x) for x in args.context_range.split(","))
    scale = D**-0.5
    engines = args.engines.split(",")
    print(
        f"Hq {HQ}, Hkv {HKV}, D {D}, {args.dtype}, contexts log-uniform {lo:.0f}-{hi:.0f}, "
        f"{args.caches} caches cycled; vLLM isa {vllm_isa} blocks of {args.vllm_block_size}; "
        f"BatchGen path {pa.decode_kernel_isa(dtype, D, HQ // HKV, args.block_size)} blocks of "
        f"{args.block_size}"
    )
    for b in (int(x) for x in args.seqs.split(",")):
        lens = _contexts(b, lo, hi, seed=b)
        g = torch.Generator().manual_seed(1)
        total = sum(lens)
        q = torch.randn(b, HQ, D, generator=g).to(dtype)
        bg_table, bg_blocks = _tables(lens, args.block_size, g)
        vl_table, vl_blocks = _tables(lens, args.vllm_block_size, g)
        bg_slots = _slots(lens, bg_table, args.block_size)
        vl_slots = _slots(lens, vl_table, args.vllm_block_size)
        kv_lens = torch.tensor(lens, dtype=torch.int64)
        seq_lens32 = kv_lens.to(torch.int32)
        qsl = torch.arange(b + 1, dtype=torch.int32)
        vl_table32 = vl_table.to(torch.int32)
        bg_caches, vl_caches, ref = [], [], None
        for c in range(args.caches):
            k_new = torch.randn(total, HKV, D, generator=g).to(dtype)
            v_new = torch.randn(total, HKV, D, generator=g).to(dtype)
            if c == 0:
                splits = torch.tensor(lens).cumsum(0).tolist()
                ks = torch.tensor_split(k_new, splits[:-1])
                vs = torch.tensor_split(v_new, splits[:-1])
                ref = _reference(q, ks, vs, lens, scale)
            kc, vc = (
                _new_cache((bg_blocks * args.block_size, HKV, D), dtype, torch.device("cpu"))
                for _ in range(2)
            )
            kc.index_copy_(0, bg_slots, k_new)
            vc.index_copy_(0, bg_slots, v_new)
            bg_caches.append((kc, vc))
            vb = args.vllm_block_size
            kv = torch.zeros(vl_blocks, HKV, vb, 2 * D, dtype=dtype)
            kv = kv.view(vl_blocks, HKV, 2 * vb, D)
            key_cache, value_cache = kv.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(
                k_new, v_new, key_cache, value_cache, vl_slots, vllm_isa
            )
            vl_caches.append((key_cache, value_cache, kv))

        def vllm_meta():
            return ops.cpu_attn_get_scheduler_metadata(
                num_reqs=b, num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_lens=seq_lens32,
                dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
                isa=vllm_isa, enable_kv_split=True,
            )

        def bg_meta():
            pa.check_decode_context(bg_table, kv_lens, args.block_size, bg_blocks)

        sched = None
        out_v = torch.empty(b, HQ, D, dtype=dtype)
        out_b = torch.empty(b, HQ, D, dtype=dtype)
        state = {"vllm": 0, "batchgen": 0}

        def vllm_call():
            kc, vc, _ = vl_caches[state["vllm"] % args.caches]
            state["vllm"] += 1
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out_v, query_start_loc=qsl,
                seq_lens=seq_lens32, scale=scale, causal=True, alibi_slopes=None,
                sliding_window=-1, block_table=vl_table32, softcap=0.0,
                scheduler_metadata=sched, s_aux=None,
            )

        def batchgen_call():
            kc, vc = bg_caches[state["batchgen"] % args.caches]
            state["batchgen"] += 1
            pa.paged_decode_attention(
                q, kc, vc, bg_table, kv_lens, args.block_size, scale, None, out_b,
                isa=args.isa, context_checked=True,
            )

        calls = {"vllm": vllm_call, "batchgen": batchgen_call}
        metas = {"vllm": vllm_meta, "batchgen": bg_meta}
        for nt in (int(x) for x in args.threads.split(",")):
            torch.set_num_threads(nt)
            sched = vllm_meta()  # sized for the thread count
            clock_name = args.clock or ("thread" if nt == 1 else "process")
            clock = {
                "thread": time.thread_time, "process": time.process_time,
                "wall": time.perf_counter,
            }[clock_name]
            # outputs of cache 0 (the reference's): both engines start from it
            state.update(vllm=0, batchgen=0)
            diffs = {}
            for name in engines:
                calls[name]()
                out = out_v if name == "vllm" else out_b
                diffs[name] = (out.float() - ref).abs().max().item()
            vb_diff = (out_v.float() - out_b.float()).abs().max().item()
            times: dict[str, list[float]] = {n: [] for n in engines}
            wall: dict[str, list[float]] = {n: [] for n in engines}
            meta_t: dict[str, list[float]] = {n: [] for n in engines}
            for r in range(args.rounds):
                for name in engines if r % 2 == 0 else engines[::-1]:
                    fn = calls[name]
                    w0, t0 = time.perf_counter(), clock()
                    for _ in range(args.calls):
                        fn()
                    times[name].append((clock() - t0) / args.calls * 1e3)
                    wall[name].append((time.perf_counter() - w0) / args.calls * 1e3)
                    t0 = clock()
                    for _ in range(10):
                        metas[name]()
                    meta_t[name].append((clock() - t0) / 10 * 1e3)
            med = {n: statistics.median(times[n]) for n in engines}
            line = [
                f"B={b:4d} ({total / b:4.0f} positions avg), {nt} thread(s), {clock_name} ms/call:"
            ]
            for n in engines:
                line.append(
                    f"{n} {med[n]:.3f} (min {min(times[n]):.3f}, wall "
                    f"{statistics.median(wall[n]):.3f}, per-step meta "
                    f"{statistics.median(meta_t[n]):.3f}, |d ref| {diffs[n]:.1e})"
                )
            if len(engines) == 2:
                ratio_min = min(times["batchgen"]) / min(times["vllm"])
                line.append(
                    f"BatchGen/vLLM {med['batchgen'] / med['vllm']:.2f} (min-based "
                    f"{ratio_min:.2f}), max |vLLM - BatchGen| {vb_diff:.1e}"
                )
            print("\n    ".join(line), flush=True)


if __name__ == "__main__":
    main()
