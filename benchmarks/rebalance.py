"""What straggler rebalancing buys: the makespan of a skewed rollouts job on data-parallel ranks,
with and without rebalancing, beside the perfectly balanced job, in one run.

    python benchmarks/rebalance.py [--quick] [--model DIR] [--requests N] [--ranks 2]
        [--interval 8] [--max-num-seqs S] [--replicated] [--kv auto|ship|recompute]

The workload is the bench's ``rollouts`` (`batchgen.bench.workloads`, greedy, EOS ignored, so
every request generates exactly its ``output_len`` tokens), ordered longest, shortest, second
longest, second shortest, ... Three jobs run it on ``--ranks`` ranks (expert-parallel, or with
``--replicated`` experts: ranks that never wait for each other):

- **balanced**: ``load_balance_method=minimum_tokens`` (each request to the rank with the
  fewest tokens in flight; with EOS ignored the estimate is exact), no rebalancing;
- **skewed**: ``round_robin``, which with this order puts every long request on rank 0, no
  rebalancing;
- **skewed + rebalancing**: ``round_robin`` with ``straggler_rebalance_interval_steps``.

The makespan is from the first request added to the last output (rank start-up excluded). It
prints the three, the two skewed ones as a multiple of the balanced one (the target for
rebalancing: within 1.15x), the rebalancing metrics and per-rank busy seconds, and checks that
the three jobs give the same tokens. Without ``--model`` it uses the bench model
(`batchgen.bench.runner`), made once under ``~/.cache/batchgen``.
"""

from __future__ import annotations

import argparse
import json
import time

from batchgen import LLM, SamplingParams
from batchgen.bench.workloads import make_workloads

TARGET = 1.15


def _skew_order(requests: list) -> list:
    """Longest, shortest, second longest, ...: round robin then gives rank 0 the long half."""
    by_length = sorted(requests, key=lambda r: (-r.output_len, -len(r.prompt_token_ids)))
    out = []
    while by_length:
        out.append(by_length.pop(0))
        if by_length:
            out.append(by_length.pop())
    return out


def _job(model: str, requests: list, args, method: str, interval: int | None) -> dict:
    kwargs = dict(data_parallel_size=args.ranks, load_balance_method=method)
    if not args.replicated:
        kwargs["enable_expert_parallel"] = True
    if interval is not None:
        kwargs["straggler_rebalance_interval_steps"] = interval
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    llm = LLM(model, **kwargs)
    engine = llm.llm_engine
    engine.rebalancer.kv_price.policy = args.kv

    got = {}
    try:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(f"r{i}", list(r.prompt_token_ids), params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id not in got, f"{out.request_id} answered twice"
                got[out.request_id] = out.outputs[0].token_ids
        makespan = time.perf_counter() - start
        metrics = llm.get_metrics()
    finally:
        llm.shutdown()
    keys = (
        "rebalance_rounds",
        "requests_moved",
        "sequences_moved",
        "requests_moved_by_recompute",
        "rebalance_tokens_recomputed",
        "rebalance_bytes_shipped",
        "requests_moved_with_kv",
        "rebalance_kv_tokens_shipped",
        "rebalance_kv_bytes_shipped",
        "rebalance_link_bytes_per_s",
        "rank_busy_seconds",
    )
    return {"makespan_s": makespan, "outputs": got, **{k: metrics[k] for k in keys}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="24 requests, a quarter as long")
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=None, help="rollouts requests (default: 256)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--interval", type=int, default=8, help="straggler_rebalance_interval_steps")
    p.add_argument("--max-num-seqs", type=int, default=None, help="per rank")
    p.add_argument("--replicated", action="store_true", help="replicated experts, no EP")
    p.add_argument(
        "--kv",
        choices=("auto", "ship", "recompute"),
        default="auto",
        help="how moved requests get their K/V: the ship-or-recompute rule, or always one",
    )
    args = p.parse_args()
    model = args.model
    if model is None:
        from batchgen.bench.runner import bench_model_path

        model = bench_model_path()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    count = args.requests or (None if args.quick else 256)
    workload = make_workloads(vocab, args.quick, rollouts_requests=count)[0]
    requests = _skew_order(list(workload.requests))
    jobs = {
        "balanced": _job(model, requests, args, "minimum_tokens", None),
        "skewed": _job(model, requests, args, "round_robin", None),
        "skewed + rebalancing": _job(model, requests, args, "round_robin", args.interval),
    }
    base = jobs["balanced"]["makespan_s"]
    same = all(j["outputs"] == jobs["balanced"]["outputs"] for j in jobs.values())
    mode = "replicated experts" if args.replicated else "expert-parallel"
    print(
        f"rollouts, {len(requests)} requests ({workload.useful_tokens} tokens to generate), "
        f"{args.ranks} {mode} ranks, rebalancing every {args.interval} steps"
    )
    for name, job in jobs.items():
        busy = ", ".join(f"{s:.1f}" for s in job["rank_busy_seconds"])
        print(
            f"  {name:<22} makespan {job['makespan_s']:7.1f} s  "
            f"{job['makespan_s'] / base:5.2f}x balanced  (rank busy s: {busy})"
        )
    moved = jobs["skewed + rebalancing"]
    ratio = moved["makespan_s"] / base
    print(
        f"rebalancing (K/V: {args.kv}): {moved['requests_moved']} requests moved "
        f"({moved['sequences_moved']} sequences; {moved['requests_moved_with_kv']} with their "
        f"K/V, {moved['rebalance_kv_tokens_shipped']} tokens, "
        f"{moved['rebalance_kv_bytes_shipped'] / 2**20:.1f} MiB; "
        f"{moved['requests_moved_by_recompute']} by recompute, "
        f"{moved['rebalance_tokens_recomputed']} tokens recomputed; "
        f"{moved['rebalance_bytes_shipped'] / 2**20:.1f} MiB released in all, link measured "
        f"{moved['rebalance_link_bytes_per_s'] / 1e6:.0f} MB/s) in {moved['rebalance_rounds']} "
        f"rounds; {ratio:.2f}x balanced (target {TARGET}x; unbalanced "
        f"{jobs['skewed']['makespan_s'] / base:.2f}x); outputs "
        f"{'identical' if same else 'DIFFER'} across the three jobs"
    )
    for name, job in jobs.items():
        want = jobs["balanced"]["outputs"]
        differ = [k for k in want if job["outputs"].get(k) != want[k]]
        if differ:
            first = [
                next(
                    (i for i, (a, b) in enumerate(zip(job["outputs"][k], want[k])) if a != b),
                    min(len(job["outputs"][k]), len(want[k])),
                )
                for k in differ
            ]
            print(
                f"  {name}: {len(differ)} of {len(want)} requests differ from balanced, first "
                f"differing token at positions {sorted(first)[:10]}"
            )
    summary = {name: {k: v for k, v in j.items() if k != "outputs"} for name, j in jobs.items()}
    print(json.dumps({**summary, "same_outputs": same}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
