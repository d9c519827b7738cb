"""Crash safety: SIGKILL ``batchgen serve`` in the middle of a batch, restart it on the same state
directory and port, and keep iterating results with the same `BatchGenClient` job."""

from __future__ import annotations

import json
import sqlite3

from service_helpers import API_KEY, Server, jsonl, make_tiny_model, slow_lines

from batchgen.service.client import BatchGenClient

NUM_REQUESTS = 16


def _rows(state_dir, batch_id) -> dict[str, tuple[str, int, dict | None]]:
    """``{custom_id: (state, attempts, result line)}`` read straight from the store."""
    db = sqlite3.connect(f"file:{state_dir / 'batchgen.sqlite3'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT custom_id, state, attempts, result FROM requests WHERE batch_id = ?",
            (batch_id,),
        ).fetchall()
    finally:
        db.close()
    return {cid: (state, n, json.loads(r) if r else None) for cid, state, n, r in rows}


def test_sigkill_mid_batch_then_restart_resumes_without_recomputing(tmp_path):
    model = make_tiny_model(tmp_path)
    state = tmp_path / "state"
    log = tmp_path / "server.log"
    extra = ("--api-key", API_KEY, "--max-in-flight", "2")
    server = Server(model, state, log, *extra).start()
    try:
        with BatchGenClient(server.url, api_key=API_KEY, timeout=30, retry_timeout=180) as c:
            src = tmp_path / "requests.jsonl"
            src.write_text(slow_lines(NUM_REQUESTS, 20, prefix="k"))
            job = c.submit_file(src)
            results = job.iter_results(poll_wait=2)
            before = [next(results) for _ in range(3)]
            server.kill()
            at_kill = _rows(state, job.id)
            done_at_kill = {k: v[2] for k, v in at_kill.items() if v[0] != "pending"}
            assert len(done_at_kill) >= 3
            assert len(done_at_kill) < NUM_REQUESTS, "the batch ended before the kill"

            server = Server(model, state, log, *extra, port=server.port).start()
            after = list(results)  # the same generator: the client retries through the restart
            final = job.wait(timeout=120)
            output = jsonl(c.download(final["output_file_id"]).decode())
    finally:
        server.stop()

    assert final["status"] == "completed", final
    assert final["error_file_id"] is None
    assert final["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
    expected = sorted(f"k-{i}" for i in range(NUM_REQUESTS))
    streamed = before + after
    assert sorted(r.custom_id for r in streamed) == expected  # each result streamed once
    assert sorted(r["custom_id"] for r in output) == expected  # output: each custom_id once
    by_id = {r["custom_id"]: r for r in output}
    attempts = {k: v[1] for k, v in _rows(state, job.id).items()}
    for result in before:
        assert by_id[result.custom_id] == result.result
    for custom_id, line in done_at_kill.items():
        # Not recomputed: the line stored before the kill (its ids are random uuids) is the
        # one in the output, and the request was handed to the engine exactly once.
        assert by_id[custom_id] == line
        assert attempts[custom_id] == 1
    assert all(n >= 1 for n in attempts.values())
    # Only requests in flight at the kill (at most --max-in-flight) ran twice.
    assert sum(attempts.values()) <= NUM_REQUESTS + 2
    assert "batchgen.service.engine_loop: batch" in log.read_text()
