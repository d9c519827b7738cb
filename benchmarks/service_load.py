"""Bounded loopback load test of ``batchgen serve`` (not part of the test suite).

8 concurrent clients each submit 20 small batches while polling ``GET /v1/batches/{id}`` for
all their outstanding batches; at the end every batch's output and error files are downloaded
and checked. Reports completed requests, lost and duplicated results (both must be 0) and the
p50/p99 latency of ``GET /v1/batches/{id}``.

    .venv/bin/python benchmarks/service_load.py                 # starts its own tiny server
    .venv/bin/python benchmarks/service_load.py --endpoint http://127.0.0.1:8000 --api-key K

Without ``--endpoint`` it builds a tiny random Mixtral (hidden 64, 2 layers) in a temporary
directory and runs ``batchgen serve`` on a free 127.0.0.1 port with a fresh state directory.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from batchgen.service.client import TERMINAL_STATUSES, BatchGenClient


def _start_server(root: Path, max_in_flight: int) -> tuple[subprocess.Popen, str]:
    from batchgen.models.make_model import make_model

    model = make_model(
        "mixtral",
        root / "model",
        seed=0,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgen.entrypoints.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--state-dir",
            str(root / "state"),
            "--device",
            "cpu",
            "--max-in-flight",
            str(max_in_flight),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((root / "server.log").read_text()[-2000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


class LoadClient(threading.Thread):
    """One client: submits ``num_batches`` batches one per round while polling the ones it
    already submitted, then downloads and checks every batch's files."""

    def __init__(self, index: int, args: argparse.Namespace) -> None:
        super().__init__(name=f"client-{index}")
        self.index, self.args = index, args
        self.latencies_ms: list[float] = []
        self.completed = self.failed = self.lost = self.duplicated = 0
        self.statuses: collections.Counter = collections.Counter()
        self.error: str | None = None

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # reported in the summary
            self.error = f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        a = self.args
        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        with (
            BatchGenClient(a.endpoint, api_key=a.api_key, timeout=60) as client,
            httpx.Client(base_url=a.endpoint, headers=headers, timeout=60) as http,
        ):
            expected: dict[str, list[str]] = {}
            outstanding: list[str] = []
            submitted = 0
            while submitted < a.batches or outstanding:
                if submitted < a.batches:
                    job = client.submit_batch(
                        [
                            f"client {self.index} batch {submitted} request {i}"
                            for i in range(a.requests)
                        ],
                        max_tokens=a.max_tokens,
                        temperature=0.0,
                    )
                    expected[job.id] = [f"prompt-{i}" for i in range(a.requests)]
                    outstanding.append(job.id)
                    submitted += 1
                for batch_id in list(outstanding):
                    t0 = time.perf_counter()
                    response = http.get(f"/v1/batches/{batch_id}")
                    self.latencies_ms.append((time.perf_counter() - t0) * 1000)
                    response.raise_for_status()
                    batch = response.json()
                    if batch["status"] in TERMINAL_STATUSES:
                        outstanding.remove(batch_id)
                        self.statuses[batch["status"]] += 1
                        self._check(client, batch, expected[batch_id])
                time.sleep(a.poll_interval)

    def _check(self, client: BatchGenClient, batch: dict, expected: list[str]) -> None:
        seen: collections.Counter = collections.Counter()
        for key in ("output_file_id", "error_file_id"):
            if batch[key]:
                for line in client.download(batch[key]).decode().splitlines():
                    result = json.loads(line)
                    seen[result["custom_id"]] += 1
                    if result["error"] is None:
                        self.completed += 1
                    else:
                        self.failed += 1
        self.lost += sum(1 for cid in expected if seen[cid] == 0)
        self.duplicated += sum(n - 1 for n in seen.values() if n > 1)
        self.duplicated += sum(1 for cid in seen if cid not in expected)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", help="an existing server (default: start a tiny one)")
    p.add_argument("--api-key", default=os.environ.get("BATCHGEN_API_KEY"))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--batches", type=int, default=20, help="batches per client")
    p.add_argument("--requests", type=int, default=4, help="requests per batch")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--poll-interval", type=float, default=0.05, help="seconds between rounds")
    p.add_argument("--max-in-flight", type=int, default=64, help="for the started server")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args()

    proc = None
    tmp = tempfile.TemporaryDirectory(prefix="batchgen-load-")
    try:
        if args.endpoint is None:
            proc, args.endpoint = _start_server(Path(tmp.name), args.max_in_flight)
        t0 = time.perf_counter()
        clients = [LoadClient(i, args) for i in range(args.clients)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        wall = time.perf_counter() - t0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        tmp.cleanup()

    latencies = [x for c in clients for x in c.latencies_ms]
    statuses: collections.Counter = collections.Counter()
    for c in clients:
        statuses.update(c.statuses)
    summary = {
        "clients": args.clients,
        "batches": args.clients * args.batches,
        "batch_statuses": dict(statuses),
        "requests": args.clients * args.batches * args.requests,
        "completed_requests": sum(c.completed for c in clients),
        "failed_requests": sum(c.failed for c in clients),
        "lost_results": sum(c.lost for c in clients),
        "duplicated_results": sum(c.duplicated for c in clients),
        "get_batch_calls": len(latencies),
        "get_batch_p50_ms": round(_percentile(latencies, 0.50), 2),
        "get_batch_p99_ms": round(_percentile(latencies, 0.99), 2),
        "get_batch_mean_ms": round(statistics.fmean(latencies), 2) if latencies else None,
        "wall_s": round(wall, 1),
        "client_errors": [c.error for c in clients if c.error],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key, value in summary.items():
            print(f"{key:>22}: {value}")
    ok = (
        not summary["client_errors"]
        and summary["lost_results"] == 0
        and summary["duplicated_results"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
