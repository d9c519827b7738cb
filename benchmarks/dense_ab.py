"""Issue 19's dense round, end to end in one process: the engine with the bf16 dense-path choice
and the RoPE + KV cache write pass of today (``after``) against the same engine with the
earlier behaviour (``before``: oneDNN at the exact row count above the multiply-add limits for
every weight, RoPE then two ``index_copy_``), alternated on fresh requests.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/dense_ab.py [--requests 32] [--rounds 3]
        [--max-tokens 64] [--threads 2] [--dtype bfloat16|float32]

``--dtype float32`` (the float32 dense round; run with ``BATCHGEN_ONEDNN_LINEAR_F32`` unset
on a CPU where its ``auto`` picks oneDNN, or ``=onednn``): ``after`` is the engine as it is
(oneDNN's prepacked path above `use_onednn_f32`'s thresholds), ``before`` every float32
projection on ``F.linear`` (the thresholds lifted); greedy tokens compared the same way.

The bench checkpoint in bfloat16; rollouts-style requests (`batchgen.bench.workloads`, the
bench's generator) cut into ``2 * --rounds`` slices of ``--requests``: round r runs slice 2r
``before`` then ``after`` and slice 2r + 1 ``after`` then ``before`` (A B B A), so that neither
side meets row counts whose oneDNN primitives the other built, as a run does. Outputs capped at
``--max-tokens`` (prefill carries the large row counts). Reports wall seconds and process CPU
seconds (``time.process_time``: all threads; on a loaded machine it counts the work, not the
waiting) per side, their ratios, and whether both sides' greedy tokens agree per request
(bf16: the two GEMM paths sum in different orders, so a near-tie may flip; counted, not
asserted).
"""

from __future__ import annotations

import argparse
import time

import torch

from batchgen import LLM, SamplingParams
from batchgen.bench.workloads import make_workloads
from batchgen.models.layers import linear as lin
from batchgen.models.layers.rotary import RotaryEmbedding

BENCH = "/root/.cache/batchgen/bench-mixtral-e64-top8-h512-l4-v1"


def _set_before(before: bool, saved: dict) -> None:
    """Switch the two changes off (``before``) or back on (float32: the oneDNN path)."""
    if saved["dtype"] == "float32":
        lin.ONEDNN_F32_MIN_MACS = 2**62 if before else saved["f32"]
        lin.ONEDNN_F32_NARROW_MIN_MACS = 2**62 if before else saved["f32_narrow"]
        return
    if before:
        lin.PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT = 0
        lin.ONEDNN_ROW_BUCKETS_PER_OCTAVE = 2**40  # step 1: the exact row count
        RotaryEmbedding.rotate_and_cache_ = lambda *a, **k: False
    else:
        lin.PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT = saved["weight"]
        lin.ONEDNN_ROW_BUCKETS_PER_OCTAVE = saved["buckets"]
        RotaryEmbedding.rotate_and_cache_ = saved["rope"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32, help="requests per slice")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=BENCH)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    saved = {
        "dtype": args.dtype,
        "f32": lin.ONEDNN_F32_MIN_MACS,
        "f32_narrow": lin.ONEDNN_F32_NARROW_MIN_MACS,
        "weight": lin.PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT,
        "buckets": lin.ONEDNN_ROW_BUCKETS_PER_OCTAVE,
        "rope": RotaryEmbedding.rotate_and_cache_,
    }
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_memory_gb=4.0,
        max_model_len=4096,
        seed=0,
        enable_prefix_caching=False,  # the second side would skip the prefill the first ran
    )
    vocab = llm.llm_engine.model_config.vocab_size
    slices = 2 * args.rounds
    reqs = make_workloads(vocab, False, rollouts_requests=slices * args.requests)[0].requests
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([[1, 5, 6, 7]] * 4, warm, use_tqdm=False)

    def run(part) -> tuple[float, float, list[list[int]]]:
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=min(r.output_len, args.max_tokens),
                ignore_eos=True,
                detokenize=False,
            )
            for r in part
        ]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in part]
        w0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        w, c = time.perf_counter() - w0, time.process_time() - c0
        return w, c, [list(o.outputs[0].token_ids) for o in outs]

    totals = {"before": [0.0, 0.0], "after": [0.0, 0.0]}
    same = total = 0
    packed = sum(type(m) is lin.PrepackedLinear for m in llm.llm_engine.runner.model.modules())
    print(
        f"{args.dtype}, {args.threads} threads, {args.requests} requests a slice, "
        f"max_tokens {args.max_tokens}, {packed} PrepackedLinear layers"
    )
    for s in range(slices):
        part = reqs[s * args.requests : (s + 1) * args.requests]
        order = ["before", "after"] if s % 2 == 0 else ["after", "before"]
        tokens = {}
        for side in order:
            _set_before(side == "before", saved)
            w, c, tokens[side] = run(part)
            totals[side][0] += w
            totals[side][1] += c
            print(f"slice {s} {side:6s} wall {w:7.2f} s  cpu {c:7.2f} s")
        _set_before(False, saved)
        same += sum(a == b for a, b in zip(tokens["before"], tokens["after"], strict=True))
        total += len(part)
    (bw, bc), (aw, ac) = totals["before"], totals["after"]
    print(
        f"total before wall {bw:.2f} s cpu {bc:.2f} s | after wall {aw:.2f} s cpu {ac:.2f} s | "
        f"before/after wall {bw / aw:.3f}x cpu {bc / ac:.3f}x | identical outputs {same}/{total}"
    )


if __name__ == "__main__":
    main()
