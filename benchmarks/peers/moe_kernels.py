"""vLLM's CPU MoE kernel against BatchGen's, alone, in one process: same weights, same routing.

    PYTHONPATH=$PWD benchmarks/peers/.venv-vllm/bin/python benchmarks/peers/moe_kernels.py \\
        --tokens 40,128,512,2048

Runs in vLLM's venv (its ``torch.ops._C`` kernels) with this repository on ``PYTHONPATH``
(BatchGen's kernel is a C++ library it builds on first use). The layer is the bench model's
(64 experts, top-8, hidden 512, expert intermediate 256), float32 or (``--dtype bfloat16``)
bfloat16. vLLM: ``cpu_fused_moe`` on weights packed by ``cpu_prepack_moe_weight`` with isa
``vec`` in float32 (what `CPUUnquantizedExperts` runs) and ``amx`` in bfloat16 (what its AMX
subclass runs where ``torch.cpu._is_amx_tile_supported()``); BatchGen: ``sort_by_expert`` + `fused_moe_silu` on `pack_expert_weights`
(what `SparseMoeBlock` runs). Each size: ``--rounds`` rounds alternating which kernel goes
first, each a loop of calls; prints the medians in ms per call, their ratio and the largest
difference of the outputs. ``--clock process`` times with the process's CPU time
(`time.process_time`, all threads together) instead of wall time: on a machine shared with
other jobs it is far less noisy, and with more than one thread it charges OpenMP's spin-waits
to the kernel that makes them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="40,128,512,2048", help="comma-separated token counts")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--clock", default="wall", choices=["wall", "process"])
    args = p.parse_args()
    import vllm._custom_ops as ops

    from batchgen.kernels.fused_moe import fused_moe_silu, pack_expert_weights
    from batchgen.models.layers.moe import sort_by_expert

    torch.manual_seed(0)
    e, a, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    dtype = getattr(torch, args.dtype)
    isa = "vec" if dtype == torch.float32 else "amx"
    if isa == "amx" and not torch._C._cpu._init_amx():  # Linux's AMX tile permission
        raise SystemExit("bfloat16: this CPU or kernel grants no AMX tile state")
    w13 = (torch.randn(e, 2 * i, h) * 0.02).to(dtype)
    w2 = (torch.randn(e, h, i) * 0.02).to(dtype)
    v13, v2 = ops.cpu_prepack_moe_weight(w13, isa), ops.cpu_prepack_moe_weight(w2, isa)
    b13, b2 = pack_expert_weights(w13), pack_expert_weights(w2)
    threads = torch.get_num_threads()
    print(
        f"E {e} top-{a} H {h} I {i}, {args.dtype} (vLLM isa {isa}), {threads} threads, "
        f"{args.clock} clock"
    )
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(t, h).to(dtype)
        weights, ids = torch.topk(torch.randn(t, e).softmax(-1), a, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).contiguous()
        ids32 = ids.to(torch.int32).contiguous()

        def vllm_call(x=x, weights=weights, ids32=ids32, t=t):
            out = torch.empty(t, h, dtype=dtype)
            ops.cpu_fused_moe(out, x, v13, v2, None, None, weights, ids32, "silu", isa)
            return out

        def batchgen_call(x=x, weights=weights, ids=ids):
            order, counts = sort_by_expert(ids, e)
            return fused_moe_silu(x, b13, b2, weights, order, counts)

        diff = (vllm_call().float() - batchgen_call().float()).abs().max().item()
        times: dict[str, list[float]] = {"vllm": [], "batchgen": []}
        calls = max(3, 2000 // t)
        pair = [("vllm", vllm_call), ("batchgen", batchgen_call)]
        clock = time.perf_counter if args.clock == "wall" else time.process_time
        for r in range(args.rounds):
            for name, fn in pair if r % 2 == 0 else pair[::-1]:
                t0 = clock()
                for _ in range(calls):
                    fn()
                times[name].append((clock() - t0) / calls * 1e3)
        mv, mb = statistics.median(times["vllm"]), statistics.median(times["batchgen"])
        print(
            f"T={t:5d} ({t * a / e:6.1f} rows/expert): vLLM {mv:7.3f} ms, BatchGen {mb:7.3f} ms, "
            f"BatchGen/vLLM {mb / mv:.2f}, max |diff| {diff:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
