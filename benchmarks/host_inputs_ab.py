"""Host Python per step, A/B in one process: another checkout's `ModelRunner.prepare` and
sampling rows against this one's, on the very same scheduled entries of a real run.

    git archive main | tar -x -C /tmp/base     # the other side, any commit
    PYTHONPATH=$PWD .venv/bin/python benchmarks/host_inputs_ab.py --base /tmp/base \\
        --requests 1024 --steps 150

Runs the engine as `benchmarks/peers/run.py` runs BatchGen (the bench checkpoint, bfloat16,
4 GiB of KV cache, ``max_model_len`` 4096, the rollouts workload's first ``--requests``,
greedy with ``ignore_eos``) for ``--steps`` steps. Every `prepare` call runs both versions,
in alternating order, and checks that their tensors are equal (AssertionError otherwise); every
step builds its sampling rows both ways (``_sampling_row``). Reports the thread CPU time
(``time.thread_time``, milliseconds per step) of each, over all steps and over the decode-only
ones: host Python, so one thread's CPU time is the cost even on a loaded machine; compare the
two sides as a ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
import types
from pathlib import Path

import torch


def _load(name: str, path: Path):
    """The module at ``path`` under ``name`` (the other checkout's, beside this one's)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same(a, b) -> None:
    """Assert that two `prepare` results are equal, field by field."""
    (ids_a, meta_a, order_a, samples_a), (ids_b, meta_b, order_b, samples_b) = a, b
    assert order_a == order_b and torch.equal(ids_a, ids_b) and torch.equal(samples_a, samples_b)
    assert torch.equal(meta_a.positions, meta_b.positions)
    assert torch.equal(meta_a.slot_mapping, meta_b.slot_mapping)
    assert len(meta_a.decode_buckets) == len(meta_b.decode_buckets)
    for x, y in zip(meta_a.decode_buckets, meta_b.decode_buckets):
        assert (x.start, x.end) == (y.start, y.end) and torch.equal(x.kv_lens, y.kv_lens)
        assert torch.equal(x.block_tables, y.block_tables)
    assert len(meta_a.prefills) == len(meta_b.prefills)
    for x, y in zip(meta_a.prefills, meta_b.prefills):
        assert (x.token_start, x.num_tokens, x.kv_len) == (y.token_start, y.num_tokens, y.kv_len)
        assert torch.equal(x.kv_slots, y.kv_slots)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the other checkout's root directory")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--steps", type=int, default=150)
    args = p.parse_args()
    from transformers import AutoConfig

    from batchgen import LLM, SamplingParams
    from batchgen.bench.runner import bench_model_path
    from batchgen.bench.workloads import make_workloads

    base = Path(args.base) / "batchgen" / "engine"
    if not base.is_dir():
        raise SystemExit(f"--base: {base} not found")
    old_runner = _load("base_model_runner", base / "model_runner.py").ModelRunner
    old_outputs = _load("base_request_outputs", base / "request_outputs.py").RequestOutputs
    path = bench_model_path("mixtral")
    llm = LLM(path, dtype="bfloat16", kv_cache_memory_gb=4.0, max_model_len=4096, seed=0)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([[1, 5, 6, 7]] * 4, warm, use_tqdm=False)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    workload = make_workloads(vocab, False, rollouts_requests=args.requests)[0]
    for i, r in enumerate(workload.requests):
        sp = SamplingParams(
            temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False
        )
        engine.add_request(f"w{i}", {"prompt_token_ids": r.prompt_token_ids}, sp)
    if hasattr(old_runner, "_slots"):  # the list-building `prepare`'s helper
        runner._slots = types.MethodType(old_runner._slots, runner)
    new_prepare, new_row, new_sample = runner.prepare, engine._sampling_row, engine._sample_isolated
    cost = dict.fromkeys(("prepare base", "prepare this", "rows base", "rows this"), 0.0)
    state = {"calls": 0, "mixed": False}

    def prepare(entries):
        state["mixed"] |= any(e.num_new_tokens != 1 for e in entries)
        state["calls"] += 1
        out = {}
        for side in ("base", "this") if state["calls"] % 2 else ("this", "base"):
            t0 = time.thread_time()
            if side == "base":
                out[side] = old_runner.prepare(runner, entries)
            else:
                out[side] = new_prepare(entries)
            cost[f"prepare {side}"] += time.thread_time() - t0
        _same(out["base"], out["this"])
        return out["this"]

    def sample_isolated(sampling, logits, failed):
        seqs = [e.seq for e in sampling]
        for side in ("base", "this") if state["calls"] % 2 else ("this", "base"):
            t0 = time.thread_time()
            if side == "base":
                [old_outputs._sampling_row(engine, s) for s in seqs]
            else:
                [new_row(s) for s in seqs]
            cost[f"rows {side}"] += time.thread_time() - t0
        return new_sample(sampling, logits, failed)

    runner.prepare, engine._sample_isolated = prepare, sample_isolated
    total = dict.fromkeys(cost, 0.0)
    decode = dict.fromkeys(cost, 0.0)
    steps = decode_steps = decode_rows = 0
    while engine.has_unfinished_requests() and steps < args.steps:
        before, state["mixed"] = dict(cost), False
        sched = engine.schedule()
        engine.execute(sched)
        steps += 1
        for k in cost:
            total[k] += cost[k] - before[k]
            if not state["mixed"]:
                decode[k] += cost[k] - before[k]
        if not state["mixed"]:
            decode_steps += 1
            decode_rows += len(sched.scheduled)
    print(f"requests {args.requests}, {steps} steps ({decode_steps} decode-only, "
          f"{decode_rows / max(decode_steps, 1):.0f} rows each), "
          f"load average {os.getloadavg()[0]:.1f}; thread CPU ms per step:")  # fmt: skip
    for name, acc, n in (("all steps", total, steps), ("decode-only", decode, decode_steps)):
        ms = {k: v / max(n, 1) * 1e3 for k, v in acc.items()}
        print(f"  {name:12s}" + "  ".join(f"{k} {v:.3f}" for k, v in ms.items()))
        if ms["prepare this"] and ms["rows this"]:
            print(f"  {'':12s}prepare base/this {ms['prepare base'] / ms['prepare this']:.2f}x, "
                  f"rows base/this {ms['rows base'] / ms['rows this']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
