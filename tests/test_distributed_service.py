"""`batchgen serve --data-parallel-size 2 --enable-expert-parallel`: a batch and an online
request give one process's tokens; stopping the server stops its ranks."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest
from service_helpers import Server, make_tiny_model, slow_lines

from batchgen import LLM, SamplingParams
from batchgen.service.client import BatchGenClient


def _rank_processes(server_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.timeout(400)
def test_service_on_two_expert_parallel_ranks(tmp_path):
    model = make_tiny_model(tmp_path)
    server = Server(
        model,
        tmp_path / "state",
        tmp_path / "server.log",
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
    ).start()
    try:
        ranks = _rank_processes(server.proc.pid)
        assert len(ranks) == 2, server.log()
        src = tmp_path / "in.jsonl"
        src.write_text(slow_lines(6, 7))
        with BatchGenClient(server.url) as client:
            jobs = client.submit_file_by_endpoint(str(src))
            results = {r.result["custom_id"]: r.result for job in jobs for r in job.iter_results()}
        online = httpx.post(
            server.url + "/v1/completions",
            json={"model": "m", "prompt": "online", "max_tokens": 5, "temperature": 0},
            timeout=120,
        ).json()
        # The ranks' token counters reach /metrics through their heartbeats (every second).
        deadline = time.monotonic() + 15
        while True:
            metrics = httpx.get(server.url + "/metrics", timeout=30).text
            if _generated(metrics) >= 6 * 7 + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        server.stop()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in ranks), "rank processes outlived the server"
    one = LLM(str(model))
    want = one.generate(
        [f"prompt number {i}" for i in range(6)],
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    for i, out in enumerate(want):
        body = results[f"r-{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == out.outputs[0].text
        assert body["usage"]["completion_tokens"] == 7
    single = (
        one.generate("online", SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    assert online["choices"][0]["text"] == single
    assert _generated(metrics) >= 6 * 7 + 1, metrics


def _generated(metrics: str) -> float:
    values = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("batchgen_generation_tokens")
    ]
    return values[0] if values else 0.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
