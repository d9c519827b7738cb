"""The fused small-op CPU kernels against the eager torch ops they replace, alternating in one
process (issue 19): routing (softmax + top-k + renormalise), the sort by expert, rotary on q and
k, rotary with the paged KV cache write (``rotary+kv write``: the rotary kernel and two
``index_copy_`` against `rotary_embedding_and_cache_`, a 4 GiB-style cache of 2^21 slots, slots
scattered), and the residual add + RMSNorm.

    .venv/bin/python benchmarks/fused_small_ops.py [--rows 70,2048] [--reps 300] [--threads 1]

Shapes are the bench model's (hidden 512, 8 heads / 2 KV heads of 64, 64 experts top-8). Per op,
dtype and row count: microseconds per call, process CPU time (``time.process_time``, so that the
other jobs of a loaded machine count less), the median of ``--rounds`` rounds in which the two
paths alternate (A, B, A, B, ...) ``--reps`` calls each; and the ratio eager / kernel.
Under ``torch.inference_mode`` as the engine runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.kernels.moe_routing import moe_sort
from batchgen.kernels.rms_norm import fused_add_rms_norm, rms_norm
from batchgen.kernels.rotary_embedding import rotary_embedding_, rotary_embedding_and_cache_
from batchgen.models.layers.rotary import RotaryEmbedding


def per_call_us(fn, reps: int) -> float:
    fn()
    t0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t0) / reps * 1e6


def ab(eager, kernel, reps: int, rounds: int) -> tuple[float, float]:
    a, b = [], []
    for _ in range(rounds):
        a.append(per_call_us(eager, reps))
        b.append(per_call_us(kernel, reps))
    return statistics.median(a), statistics.median(b)


def cases(rows: int, dtype: torch.dtype):
    """``(name, eager, kernel)`` closures on random inputs of ``rows`` tokens."""
    torch.manual_seed(0)
    logits = torch.randn(rows, 64).to(dtype)

    def routing_eager():
        w, ids = torch.topk(torch.softmax(logits.float(), -1), 8, -1)
        return w / w.sum(-1, keepdim=True), ids

    from batchgen.kernels.moe_routing import topk_softmax

    ids = torch.randint(0, 64, (rows, 8))

    def sort_eager():
        flat = ids.reshape(-1)
        return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=64).tolist()

    def sort_kernel():
        order, counts = moe_sort(ids, 64)
        return order, counts.tolist()

    rope = RotaryEmbedding(64, {"rope_theta": 1e6})
    qkv = torch.randn(rows, 12 * 64).to(dtype)
    q, k = qkv[:, :512].view(rows, 8, 64), qkv[:, 512:640].view(rows, 2, 64)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (rows,)), dtype)

    def rope_eager():
        return rope.forward(None, q, k, {(rope.cache_key, dtype): (cos, sin)})

    v = qkv[:, 640:].view(rows, 2, 64)
    num_slots = 2**21  # the bench's 4 GiB budget in bf16 holds about this many per layer
    k_cache = torch.zeros(num_slots, 2, 64, dtype=dtype)
    v_cache = torch.zeros(num_slots, 2, 64, dtype=dtype)
    slots = torch.randperm(num_slots)[:rows]

    def rope_then_index_copy():
        rotary_embedding_(q, k, cos, sin)
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def rope_and_cache():
        rotary_embedding_and_cache_(q, k, v, cos, sin, (k_cache, v_cache), slots)

    h, x = torch.randn(rows, 512).to(dtype), torch.randn(rows, 512).to(dtype)
    w = torch.randn(512).to(dtype)
    return [
        ("routing", routing_eager, lambda: topk_softmax(logits, 8, True)),
        ("sort_by_expert", sort_eager, sort_kernel),
        ("rotary q,k", rope_eager, lambda: rotary_embedding_(q, k, cos, sin)),
        ("rotary+kv write", rope_then_index_copy, rope_and_cache),
        ("add+rms_norm", lambda: rms_norm(h + x, w, 1e-5),
         lambda: fused_add_rms_norm(x, h, w, 1e-5)),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="70,2048")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, process CPU time, median of {args.rounds} A/B rounds")
    print(f"{'op':<16}{'dtype':<10}{'rows':>6}{'eager us':>10}{'kernel us':>11}{'ratio':>7}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            reps = max(5, args.reps * 70 // max(rows, 70))
            for dtype in (torch.float32, torch.bfloat16):
                for name, eager, kernel in cases(rows, dtype):
                    e, f = ab(eager, kernel, reps, args.rounds)
                    dt = str(dtype).removeprefix("torch.")
                    print(f"{name:<16}{dt:<10}{rows:>6}{e:>10.1f}{f:>11.1f}{e / f:>7.2f}")


if __name__ == "__main__":
    main()
