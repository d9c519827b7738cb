"""Skewed loads, dead and stuck ranks, and the batch CLI on several ranks.

Every case carries a timeout: a hang is a failure, never a stuck CI run. Rank processes are
stopped by the frontend (or killed here) before each test returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams

BIN = Path(sys.executable).parent


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ep_llm(checkpoint_dir):
    """Two expert-parallel ranks shared by the skew tests."""
    llm = LLM(str(checkpoint_dir("qwen2_moe")), data_parallel_size=2, enable_expert_parallel=True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def single(checkpoint_dir):
    return LLM(str(checkpoint_dir("qwen2_moe")))


def _drain(engine, timeout: float = 120.0) -> dict:
    done, deadline = {}, time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the job did not finish: a hang"
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.mark.timeout(240)
def test_every_request_on_one_rank(ep_llm, single):
    """Rank 1 has no request at all: it must still join every layer's dispatch/combine
    (dummy steps) and the job must end."""
    engine = ep_llm.llm_engine
    prompts = ["one rank only", "still rank zero", "and again"]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"skew-{i}", prompt, _greedy(10), data_parallel_rank=0)
    got = _drain(engine)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, _greedy(10), use_tqdm=False)]
    assert [got[f"skew-{i}"] for i in range(3)] == want
    ranks = ep_llm.get_metrics()["ranks"]
    assert ranks[1]["generated_tokens"] == 0 and ranks[1]["dummy_steps"] > 0


@pytest.mark.timeout(240)
def test_one_request_in_total(ep_llm, single):
    out = ep_llm.generate(["a single request"], _greedy(6), use_tqdm=False)
    want = single.generate(["a single request"], _greedy(6), use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids


@pytest.mark.timeout(240)
def test_ranks_finishing_at_different_steps(ep_llm, single):
    """One long request on rank 0, many one-token requests on rank 1 (done long before), and
    requests that stop mid-step on both; then a second wave reuses the idle ranks."""
    engine = ep_llm.llm_engine
    cases = [("long", "a long one", 40, 0)]
    cases += [(f"short-{i}", f"short {i}", 1, 1) for i in range(6)]
    cases += [(f"mid-{i}", f"stops at {i}", 3 + i, i % 2) for i in range(4)]
    for rid, prompt, n, rank in cases:
        engine.add_request(rid, prompt, _greedy(n), data_parallel_rank=rank)
    got = _drain(engine)
    for rid, prompt, n, _ in cases:
        want = single.generate([prompt], _greedy(n), use_tqdm=False)[0].outputs[0].token_ids
        assert got[rid] == want, rid
    second = ep_llm.generate(["wave two", "again"], _greedy(5), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in second)


@pytest.mark.timeout(120)
def test_bad_data_parallel_rank_is_refused(ep_llm):
    with pytest.raises(ValueError, match="data_parallel_rank must be in"):
        ep_llm.llm_engine.add_request("x", "hi", _greedy(2), data_parallel_rank=2)
    assert not ep_llm.llm_engine.has_unfinished_requests()


def _batch_file(path: Path, n: int, max_tokens: int) -> None:
    lines = [
        json.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "prompt": f"request {i} " * (1 + i % 5),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        )
        for i in range(n)
    ]
    lines[3] = "{not json"
    lines[5] = json.dumps(
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
    )
    lines[7] = json.dumps(
        {
            "custom_id": "req-1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "a duplicate"},
        }
    )
    lines[9] = json.dumps(
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "max_tokens": 10**7},
        }
    )
    path.write_text("\n".join(lines) + "\n")


def _results(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        key = (d["custom_id"], (d.get("error") or {}).get("line"))
        assert key not in out, f"{key} answered twice"
        body = d["response"]["body"]
        out[key] = (d["response"]["status_code"], body.get("choices", [{}])[0].get("text"))
    return out


def _cli(*args, **kw):
    env = dict(os.environ, BATCHGEN_LOG_LEVEL="WARNING")
    return subprocess.run(
        [str(BIN / "batchgen"), "run", "--no-progress", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        **kw,
    )


@pytest.mark.timeout(300)
def test_batch_file_on_two_ranks_matches_one_process(checkpoint_dir, tmp_path):
    model = str(checkpoint_dir("mixtral"))
    src = tmp_path / "in.jsonl"
    _batch_file(src, 14, 6)
    one = _cli("-i", str(src), "-o", str(tmp_path / "one.jsonl"), "--model", model)
    two = _cli(
        "-i",
        str(src),
        "-o",
        str(tmp_path / "two.jsonl"),
        "--model",
        model,
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
    )
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a, b = _results(tmp_path / "one.jsonl"), _results(tmp_path / "two.jsonl")
    assert a == b
    assert len(a) == 14  # one line per input line, errors included
    assert sum(status == 400 for status, _ in a.values()) == 4


def _start_cli(*args) -> subprocess.Popen:
    """`batchgen run --no-progress ARGS` in the background, output captured."""
    return subprocess.Popen(
        [str(BIN / "batchgen"), "run", "--no-progress", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, BATCHGEN_LOG_LEVEL="WARNING"),
    )


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _rank_pids(cli: subprocess.Popen, world: int, timeout: float = 120.0) -> dict[int, int]:
    """rank -> pid of the rank processes the CLI started (from their command lines)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = {}
        for pid in _children(cli.pid):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"batchgen.distributed.launch" in args:
                pids[int(args[args.index(b"--rank") + 1])] = pid
        if len(pids) == world:
            return pids
        time.sleep(0.2)
    raise AssertionError("rank processes not found")


def _wait_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} results after {timeout} s")


@pytest.mark.timeout(400)
def test_killed_rank_is_named_and_resume_completes_exactly_once(checkpoint_dir, tmp_path):
    model = str(checkpoint_dir("mixtral"))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _batch_file(src, 40, 48)
    cli = _start_cli(
        "-i",
        str(src),
        "-o",
        str(out),
        "--model",
        model,
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--max-in-flight",
        "8",
    )
    try:
        pids = _rank_pids(cli, 2)
        _wait_lines(out, 6, cli)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        _, stderr = cli.communicate(timeout=60)
        reported_after = time.monotonic() - killed_at
    finally:
        if cli.poll() is None:
            cli.kill()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert cli.returncode == 1, stderr
    assert "rank 1" in stderr and "SIGKILL" in stderr, stderr
    assert reported_after < 30
    partial = _results(out)  # every line whole and unique
    assert 6 <= len(partial) < 40
    resumed = _cli("-i", str(src), "-o", str(out), "--model", model, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    final = _results(out)  # raises on a custom_id answered twice
    assert len(final) == 40
    assert {k: v for k, v in final.items() if k in partial} == partial


@pytest.mark.timeout(300)
def test_stuck_rank_is_named_within_the_timeout(checkpoint_dir):
    llm = LLM(
        str(checkpoint_dir("mixtral")),
        data_parallel_size=2,
        enable_expert_parallel=True,
        distributed_timeout_s=4.0,
    )
    engine = llm.llm_engine
    try:
        stopped = engine._ranks[1].pid
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        engine.add_request("r", "hello", _greedy(30))
        with pytest.raises(RuntimeError, match=r"rank 1 .*silent") as info:
            _drain(engine, timeout=60)
        assert time.monotonic() - t0 < 20
        assert info.value.ranks == [1], str(info.value)
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
        llm.shutdown()


@pytest.mark.timeout(120)
def test_outputs_taken_in_by_a_metrics_read_are_still_returned(ep_llm):
    """The service reads `stats` between steps; that read takes in finished outputs, which
    `step` must still return (a served batch once waited forever for them)."""
    engine = ep_llm.llm_engine
    engine.add_request("polled", "polled between steps", _greedy(3))
    for rank in engine._ranks:
        engine._flush(rank)
    deadline = time.monotonic() + 60
    while not engine._finished:
        assert time.monotonic() < deadline
        engine.stats  # noqa: B018 (the read takes in messages)
        time.sleep(0.05)
    assert engine.has_unfinished_requests()
    assert [o.request_id for o in engine.step()] == ["polled"]
    assert not engine.has_unfinished_requests()


@pytest.mark.timeout(240)
def test_frontend_sending_while_ranks_send_cannot_deadlock(ep_llm):
    """Ranks fill their pipes with large outputs (20 logprobs per token) while the frontend is
    not stepping; then the frontend sends a second large wave of requests. With blocking sends
    on both sides this deadlocked: rank 1 blocked writing outputs nobody read, rank 0 waited for
    rank 1 in a collective, the frontend blocked writing to rank 0 (an adversarial run hung
    until gloo's 300 s timeout). The frontend's sends must return at once and the job end."""
    engine = ep_llm.llm_engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=20)
    for i in range(1000):
        engine.add_request(f"wave1-{i}", f"first wave {i} " * 4, params)
    for rank in engine._ranks:
        engine._flush(rank)
    time.sleep(10)  # the ranks run; megabytes of outputs pile up unread
    start = time.monotonic()
    for i in range(2000):  # about 7 KB each: more than the sockets buffer
        engine.add_request(f"wave2-{i}", f"second wave {i} " * 100, _greedy(1))
    for rank in engine._ranks:
        engine._flush(rank)
    assert time.monotonic() - start < 30, "sending requests waited for the ranks"
    done = _drain(engine, timeout=180)
    assert len(done) == 3000
    assert {len(t) for r, t in done.items() if r.startswith("wave1")} == {24}
    assert {len(t) for r, t in done.items() if r.startswith("wave2")} == {1}
