"""Decode step time with the per-call choices and the lost pre-norm (issue 19) against the
choices made once and the normed rows carried through coalesced steps, alternated in one
process on the bench model.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/step_choices_ab.py [--requests 70]
        [--steps 60] [--group-tokens 2048] [--policies coalesce,lockstep] [--threads 1]

``before``: every MoE block decides its expert path (`SparseMoeBlock.unpin_expert_path`) and
every RMSNorm asks `rms_norm_available` (`RMSNorm.unpin_kernel`) per call, and the executor
concatenates / splits coalesced groups with plain ``torch.cat`` / ``split`` (the FFN and the
next attention norm again). ``after``: the engine's pins, `cat_prenormed` / `split_prenormed`.

Per policy: ``--requests`` greedy requests (random 24-token prompts, the bench's vocabulary)
are prefilled, then ``--steps`` decode-only steps are timed one by one in thread CPU time
(``time.thread_time``, on one thread: other jobs on a loaded machine count less), the
configuration switched step by step in the order A B B A (so the context's growth cancels);
reported: the median milliseconds per step of each and their ratio. ``--group-tokens`` below
the request count cuts the decode tokens into several groups (coalesced FFN under
``coalesce``; lockstep keeps one group).
Then ``--check-tokens`` tokens per request are generated fully under each configuration and
compared (greedy; they must be identical).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import batchgen.engine.executor as executor
from batchgen import LLM, SamplingParams
from batchgen.models.layers.moe import SparseMoeBlock
from batchgen.models.layers.norm import RMSNorm

BENCH = "/root/.cache/batchgen/bench-mixtral-e64-top8-h512-l4-v1"
CARRY = (executor.cat_prenormed, executor.split_prenormed)


def configure(llm: LLM, after: bool) -> None:
    """Switch the engine's model and executor to ``after`` or ``before`` (module docstring)."""
    engine = llm.llm_engine
    for m in engine.runner.model.modules():
        if isinstance(m, SparseMoeBlock):
            m.pin_expert_path(engine.device, engine.dtype) if after else m.unpin_expert_path()
        elif isinstance(m, RMSNorm):
            m.pin_kernel(engine.device, engine.dtype) if after else m.unpin_kernel()
    if after:
        executor.cat_prenormed, executor.split_prenormed = CARRY
    else:
        executor.cat_prenormed = torch.cat
        executor.split_prenormed = lambda h, sizes: h.split(sizes)


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (24,), generator=g).tolist() for _ in range(n)]


def timed_steps(llm: LLM, reqs: list[list[int]], steps: int) -> dict[str, list[float]]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    configure(llm, True)
    for _ in range(8):  # prefill (and a few decode steps as warm-up)
        engine.step()
    times: dict[str, list[float]] = {"before": [], "after": []}
    for i in range(steps):
        after = (i % 4) in (1, 2)  # A B B A ...
        configure(llm, after)
        t0 = time.thread_time()
        engine.step()
        times["after" if after else "before"].append((time.thread_time() - t0) * 1e3)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    configure(llm, True)
    return times


def tokens(llm: LLM, reqs: list[list[int]], after: bool, n: int) -> list[list[int]]:
    configure(llm, after)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in reqs], params, use_tqdm=False)
    configure(llm, True)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=BENCH)
    p.add_argument("--requests", type=int, default=70)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--group-tokens", type=int, default=2048)
    p.add_argument("--policies", default="coalesce,lockstep")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check-tokens", type=int, default=24)
    args = p.parse_args()
    # The engine sets its threads from OMP_NUM_THREADS (`batchgen.engine.cpu_threads`); thread
    # CPU time counts only this thread, so the kernels must run on it.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    for policy in args.policies.split(","):
        llm = LLM(args.model, device="cpu", dtype="bfloat16", scheduler_policy=policy,
                  max_num_seqs=args.requests, max_num_batched_tokens=args.group_tokens,
                  expert_coalesce_threshold=10_000, kv_cache_memory_gb=0.5)  # fmt: skip
        assert torch.get_num_threads() == args.threads, torch.get_num_threads()
        reqs = prompts(args.requests, llm.llm_engine.model_config.vocab_size)
        times = timed_steps(llm, reqs, args.steps)
        a, b = statistics.median(times["before"]), statistics.median(times["after"])
        # The spread: quartiles of each side, and of the before/after ratio per A B B A block.
        quart = {k: [round(q, 3) for q in statistics.quantiles(v, n=4)] for k, v in times.items()}
        blocks = [
            (aa[0] + aa[1]) / (bb[0] + bb[1])
            for aa, bb in zip(
                zip(times["before"][::2], times["before"][1::2]),
                zip(times["after"][::2], times["after"][1::2]),
            )
        ]
        block_q = [round(q, 4) for q in statistics.quantiles(blocks, n=4)] if blocks[1:] else []
        same = tokens(llm, reqs, False, args.check_tokens) == tokens(
            llm, reqs, True, args.check_tokens
        )
        row = dict(policy=policy, group_tokens=args.group_tokens, requests=args.requests,
                   steps_each=len(times["before"]), before_ms=round(a, 3), after_ms=round(b, 3),
                   before_over_after=round(a / b, 4), quartiles_ms=quart,
                   block_ratio_quartiles=block_q, tokens_identical=same)  # fmt: skip
        print("STEP_CHOICES", json.dumps(row), flush=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
