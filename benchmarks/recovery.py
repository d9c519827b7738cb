"""What elastic recovery costs: a rank SIGKILLed mid-job, measured against the same job
without the kill, in one run.

    python benchmarks/recovery.py [--model DIR] [--requests 256] [--max-tokens 64]
        [--kill-after 0.5 | --kill-at-time 0.5] [--ranks 2] [--expert-parallel-size E]
        [--straggler-rebalance-interval-steps K]

Runs the job twice on ``--ranks`` ranks with ``enable_elastic_recovery`` (one expert-parallel
group of all of them; ``--expert-parallel-size E`` cuts them into groups of E, 1 replicating
the experts, so that a kill restarts only the dead rank's group and the others run on): once
untouched, once with rank 1 killed after ``--kill-after`` of the requests have finished (or,
with ``--kill-at-time F``, once F times the untouched run's wall time has passed: a rank returns
a batch of equal requests together, so on a busy machine both ranks' batches may finish in the
same step and leave nothing to kill at a share of requests). Prints
the wall time of both, the time from the kill to the next finished output (the job making
progress again), the frontend's ``recovery_seconds`` (failure report to ranks running again),
requests re-queued and tokens recomputed, and checks that every request was answered once with
the same tokens as the untouched run. Without ``--model`` it uses the bench model
(`batchgen.bench.runner`), made once under ``~/.cache/batchgen``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from batchgen import LLM, SamplingParams


def _job(model: str, args, kill: bool, kill_at_s: float | None = None) -> dict:
    layout = (
        {"enable_expert_parallel": True}
        if args.expert_parallel_size is None
        else {"expert_parallel_size": args.expert_parallel_size}
    )
    llm = LLM(
        model,
        data_parallel_size=args.ranks,
        enable_elastic_recovery=True,
        straggler_rebalance_interval_steps=args.straggler_rebalance_interval_steps,
        **layout,
    )
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", f"recovery benchmark request {i} " * (1 + i % 8), params)
    got, killed_at, resumed_at = {}, None, None
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            if outs and killed_at is not None and resumed_at is None:
                resumed_at = now
            for out in outs:
                assert out.request_id not in got, f"{out.request_id} answered twice"
                got[out.request_id] = out.outputs[0].token_ids
            due = (
                now - start >= kill_at_s
                if kill_at_s is not None
                else len(got) >= args.kill_after * args.requests
            )
            if (
                kill
                and killed_at is None
                and due
                and engine.has_unfinished_requests()  # else nothing is left to recover
            ):
                os.kill(engine._ranks[1].pid, signal.SIGKILL)
                killed_at = time.perf_counter()
        wall = time.perf_counter() - start
        metrics = llm.get_metrics()
    finally:
        llm.shutdown()
    return {
        "wall_seconds": wall,
        "outputs": got,
        "kill_to_progress_seconds": None if resumed_at is None else resumed_at - killed_at,
        **{
            k: metrics[k]
            for k in ("recoveries", "requests_requeued", "recovery_seconds", "tokens_recomputed")
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kill-after", type=float, default=0.5, help="share of requests finished")
    p.add_argument(
        "--kill-at-time",
        type=float,
        default=None,
        metavar="F",
        help="kill once F x the untouched run's wall time has passed (instead of --kill-after)",
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--expert-parallel-size", type=int, default=None, metavar="E")
    p.add_argument(
        "--straggler-rebalance-interval-steps",
        type=int,
        default=None,
        metavar="K",
        help="rebalance every K steps (then a replacement, once ready, can take re-queued work)",
    )
    args = p.parse_args()
    model = args.model
    if model is None:
        from batchgen.bench.runner import bench_model_path

        model = bench_model_path()
    clean = _job(model, args, kill=False)
    kill_at_s = None if args.kill_at_time is None else args.kill_at_time * clean["wall_seconds"]
    killed = _job(model, args, kill=True, kill_at_s=kill_at_s)
    if killed["kill_to_progress_seconds"] is None:
        raise SystemExit(
            "the requests all finished in the step that reached --kill-after, so nothing was "
            "left to recover: run again, or with a lower --kill-after, more --max-tokens, or "
            "--kill-at-time"
        )
    assert killed["recoveries"] == 1, killed
    same = killed["outputs"] == clean["outputs"]
    print(f"untouched: {clean['wall_seconds']:.1f} s")
    when = (
        f"after {args.kill_after:.0%} of {args.requests} requests"
        if kill_at_s is None
        else f"at {kill_at_s:.1f} s ({args.kill_at_time:.0%} of the untouched wall time)"
    )
    print(
        f"rank 1 killed {when}: "
        f"{killed['wall_seconds']:.1f} s ({killed['wall_seconds'] / clean['wall_seconds']:.2f}x); "
        f"kill to next output {killed['kill_to_progress_seconds']:.1f} s, recovery "
        f"{killed['recovery_seconds']:.1f} s, {killed['requests_requeued']} requests re-queued, "
        f"about {killed['tokens_recomputed']} tokens recomputed; every request once, "
        f"{'same tokens' if same else 'TOKENS DIFFER'} as the untouched run"
    )
    summary = {k: v for k, v in killed.items() if k != "outputs"}
    print(json.dumps({"clean_wall_seconds": clean["wall_seconds"], **summary, "same": same}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
