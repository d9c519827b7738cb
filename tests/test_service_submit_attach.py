"""`batchgen submit --batch-id`: an interrupted submit leaves its batches running on the
server and prints the command that collects them; that command writes every result of the
batches once, without starting new ones. Every case carries a timeout; the server is stopped
at the end of the module."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from service_helpers import API_KEY, BATCHGEN, Server, env, jsonl, make_tiny_model, slow_lines

from batchgen.service.client import BatchGenClient


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("svc_attach")
    model = make_tiny_model(root / "model")
    srv = Server(
        model, root / "state", root / "server.log", "--api-key", API_KEY, "--max-in-flight", "2"
    ).start()
    yield srv
    srv.stop()


def _cli(tmp_path, *args: str, **kwargs) -> list[str]:
    return [*BATCHGEN, "submit", *args, "--api-key", API_KEY, "--no-progress"]


@pytest.mark.timeout(300)
def test_an_interrupted_submit_is_collected_with_the_batch_id_it_prints(server, tmp_path):
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text(slow_lines(8, 48, prefix="attach"))
    with BatchGenClient(server.url, api_key=API_KEY, timeout=30) as client:
        before = len(client.list_batches(limit=100))
    proc = subprocess.Popen(
        _cli(tmp_path, "-i", str(src), "-o", str(out), "--endpoint", server.url),
        env=env(tmp_path),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 200
        while (not out.exists() or not out.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the first result is written: the batch runs
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    hint = [line for line in stderr.splitlines() if "to collect its results" in line]
    assert len(hint) == 1, stderr
    command = hint[0].split("to collect its results: batchgen submit ", 1)[1].split()
    assert command[0] == "--batch-id" and command[2:] == [
        "-o", str(out), "--endpoint", server.url,
    ]
    again = subprocess.run(
        _cli(tmp_path, *command), env=env(tmp_path), capture_output=True, text=True, timeout=240
    )
    assert again.returncode == 0, again.stderr
    results = jsonl(out.read_text())
    assert sorted(r["custom_id"] for r in results) == [f"attach-{i}" for i in range(8)]
    assert all(r["error"] is None for r in results)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 48 for r in results)
    assert ": 8 ok, 0 failed" in again.stderr
    with BatchGenClient(server.url, api_key=API_KEY, timeout=30) as client:
        assert len(client.list_batches(limit=100)) == before + 1  # no batch started again


@pytest.mark.timeout(120)
def test_submit_takes_an_input_or_batch_ids_and_names_an_unknown_batch(server, tmp_path):
    out = tmp_path / "results.jsonl"
    unknown = subprocess.run(
        _cli(tmp_path, "--batch-id", "batch_nope", "-o", str(out), "--endpoint", server.url),
        env=env(tmp_path), capture_output=True, text=True, timeout=60,
    )
    assert unknown.returncode == 2
    assert "batch_nope" in unknown.stderr
    for args in ([], ["-i", "x.jsonl", "--batch-id", "b"]):
        proc = subprocess.run(
            _cli(tmp_path, *args, "-o", str(out)), env=env(tmp_path),
            capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 2
        assert "-i/--input" in proc.stderr and "--batch-id" in proc.stderr
