"""Split the expert-parallel all-to-all time of a run into waiting for the peer and moving the
bytes, from the traces the ranks write with ``BATCHGEN_A2A_TRACE=<folder>``:

    BATCHGEN_A2A_TRACE=/tmp/tr batchgen bench --data-parallel-size 2 --enable-expert-parallel \\
        --workloads rollouts --rollouts-requests 128 --modes coalesce
    python benchmarks/a2a_trace.py /tmp/tr

Every rank of a group issues the same collectives in the same order, so the i-th entry of each
rank's trace is one collective. For rank r and collective i (times on the host's one
CLOCK_MONOTONIC): ``wait = max_s(enter_s) - enter_r`` (the peer was not there yet),
``transfer = exit_r - max_s(enter_s)`` (everyone in: bytes, packing inside gloo), and
``compute`` = the time from the previous collective's exit to this one's enter (attention,
router, experts, packing, the control exchange: everything that is not an all-to-all).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def split(traces: list[list]) -> list[dict]:
    """Per rank: seconds of waiting, transfer, and compute between collectives, by kind.

    Args:
        traces: one list per rank of ``(kind, enter_ns, exit_ns, recv_bytes)``, same length.
    Raises:
        ValueError: the traces differ in length or kinds (not the same collectives).
    """
    n = {len(t) for t in traces}
    if len(n) != 1:
        raise ValueError(f"traces differ in length: {[len(t) for t in traces]}")
    out = []
    for r, trace in enumerate(traces):
        acc: dict[str, dict[str, float]] = {}
        prev_exit = None
        for i, (kind, enter, exit_, nbytes) in enumerate(trace):
            kinds = {t[i][0] for t in traces}
            if len(kinds) != 1:
                raise ValueError(f"collective {i}: kinds differ across ranks: {kinds}")
            last_in = max(t[i][1] for t in traces)
            a = acc.setdefault(
                kind, {"calls": 0, "wait": 0.0, "transfer": 0.0, "compute_before": 0.0, "bytes": 0}
            )
            a["calls"] += 1
            a["wait"] += (last_in - enter) / 1e9
            a["transfer"] += max(0, exit_ - last_in) / 1e9
            a["bytes"] += nbytes
            if prev_exit is not None:
                a["compute_before"] += (enter - prev_exit) / 1e9
            prev_exit = exit_
        out.append({"rank": r, "by_kind": acc, "span": (trace[-1][2] - trace[0][1]) / 1e9})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder")
    args = p.parse_args()
    files = sorted(Path(args.folder).glob("a2a_trace_rank*.json"))
    if not files:
        raise SystemExit(f"no a2a_trace_rank*.json in {args.folder}")
    data = [json.loads(f.read_text()) for f in files]
    data.sort(key=lambda d: d["ep_rank"])
    result = split([d["trace"] for d in data])
    for r in result:
        print(f"rank {r['rank']}: {r['span']:.2f} s from first to last collective")
        for kind, a in r["by_kind"].items():
            ms = 1e3 / max(1, a["calls"])
            print(
                f"  {kind:<8} {a['calls']:>6} calls: wait {a['wait']:7.2f} s "
                f"({a['wait'] * ms:6.2f} ms/call), transfer {a['transfer']:7.2f} s "
                f"({a['transfer'] * ms:6.2f} ms/call, {a['bytes'] / 2**20:8.0f} MiB in, "
                f"{a['bytes'] / max(a['transfer'], 1e-9) / 1e6:6.0f} MB/s), compute before "
                f"{a['compute_before']:7.2f} s"
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
