"""CPU thread settings on an idle and on a loaded machine: tokens/s of one `LLM.generate` call
per setting, each in a fresh process (OpenMP reads its settings when torch loads it).

    .venv/bin/python benchmarks/cpu_threads.py [--loads 0,1,2] [--repeats 3] \
        [--settings default,batchgen,passive,spin10k,kmp0,one] [--model DIR]

Settings (the environment of the measured process):

- ``default``: nothing set, torch's default threads (libgomp spins ~300k iterations at a
  barrier before it sleeps);
- ``batchgen``: what ``batchgen run/serve/bench`` do (`batchgen.engine.cpu_threads`: a short
  spin, ``GOMP_SPINCOUNT=10000``, or ``OMP_WAIT_POLICY=PASSIVE`` when the load average is
  already 1 or more when the process starts; the line names the policy each run got);
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE``; ``spin10k``: ``GOMP_SPINCOUNT=10000``;
  ``kmp0``: ``KMP_BLOCKTIME=0`` (Intel OpenMP's knob; torch's CPU wheels use GNU OpenMP);
- ``one``: ``OMP_NUM_THREADS=1``.

``--loads`` lists how many busy processes (a pure-Python spin loop each) run beside the
measurement: 0 is the idle machine, 1 is "another busy process". The load average before each
load level is printed, since other jobs on a shared machine add to it. Workload: the embedded
default model (Mixtral architecture, hidden 128, 8 experts, 4 layers; or ``--model``),
``--prompts`` greedy prompts of ``--max-tokens`` tokens, after a warm-up call. Prints the
median and the best tokens/s of each setting at each load, with their ratios to the first
setting's (the best run is the one least disturbed by other jobs on a shared machine), and the
load average before and after each load level.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "default": {},
    "batchgen": None,  # set by `set_openmp_wait_policy` in the child
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin100k": {"GOMP_SPINCOUNT": "100000"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
    "spin100": {"GOMP_SPINCOUNT": "100"},
    "kmp0": {"KMP_BLOCKTIME": "0"},
    "one": {"OMP_NUM_THREADS": "1"},
}
_THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _child(args: argparse.Namespace) -> None:
    if args.setting == "batchgen":
        from batchgen.engine.cpu_threads import set_openmp_wait_policy

        set_openmp_wait_policy()
    import torch

    from batchgen import LLM, SamplingParams

    llm = LLM(args.model, device="cpu", scheduler_policy=args.policy, kv_cache_memory_gb=0.25)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[1 + (7 * i + j) % 500 for j in range(16 + i % 16)] for i in range(args.prompts)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    policy = ",".join(f"{k}={os.environ[k]}" for k in _THREAD_VARS[1:] if k in os.environ)
    print(
        json.dumps(
            {
                "tokens_per_s": tokens / seconds,
                "threads": torch.get_num_threads(),
                "policy": policy or "libgomp default",
            }
        )
    )


def _measure(args: argparse.Namespace, setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_VARS}
    env.update(SETTINGS[setting] or {})
    cmd = [sys.executable, __file__, "--child", "--setting", setting]
    cmd += ["--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)]
    cmd += ["--policy", args.policy] + (["--model", args.model] if args.model else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{setting}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loads", default="0,1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--settings", default="default,batchgen,one")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--policy", default="lockstep", choices=["lockstep", "coalesce"])
    p.add_argument("--model", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setting", default="default", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; allowed {list(SETTINGS)}")
    print(
        f"{len(os.sched_getaffinity(0))} CPUs; {args.prompts} prompts x {args.max_tokens} "
        f"tokens, {args.policy}; median of {args.repeats}"
    )
    for load in (int(x) for x in args.loads.split(",")):
        rates: dict[str, list[float]] = {s: [] for s in settings}
        policies: dict[str, set[str]] = {s: set() for s in settings}
        before = os.getloadavg()[0]
        busy = _busy(load)
        try:
            for _ in range(args.repeats):  # interleaved, so drifting load hits every setting
                for setting in settings:
                    result = _measure(args, setting)
                    rates[setting].append(result["tokens_per_s"])
                    policies[setting].add(result["policy"])
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
        base = statistics.median(rates[settings[0]])
        best_base = max(rates[settings[0]])
        after = os.getloadavg()[0]
        print(f"busy processes {load} (load average before {before:.2f}, after {after:.2f})")
        for setting in settings:
            med, best = statistics.median(rates[setting]), max(rates[setting])
            runs = ", ".join(f"{r:.0f}" for r in rates[setting])
            print(
                f"  {setting:<9} median {med:7.1f} tok/s x{med / base:5.2f}, best {best:7.1f} "
                f"x{best / best_base:5.2f}  ({runs}; {' / '.join(sorted(policies[setting]))})"
            )


if __name__ == "__main__":
    main()
