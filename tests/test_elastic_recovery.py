"""Elastic recovery (`enable_elastic_recovery`): a rank that dies or goes silent does not end the
job; the ranks start again, the unfinished requests are re-queued, and every request is answered
exactly once with the tokens one process gives. A rank's own error still ends the job, and so
does a failure after `MAX_RECOVERIES` restarts. A rank that dies while the ranks start (a restart
or the first start) is one more failure, retried within the same budget.

Every case carries a timeout and stops its rank processes before returning.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from test_distributed_faults import (
    _batch_file,
    _cli,
    _drain,
    _greedy,
    _rank_pids,
    _results,
    _start_cli,
    _wait_lines,
)

from batchgen import LLM
from batchgen.distributed import rank_set, recovery
from batchgen.distributed.rank_process import LocalRankProcess
from batchgen.distributed.rank_set import RankFailedError


def _prompts(n: int) -> list[str]:
    return [f"recovery prompt {i} " * (1 + i % 4) for i in range(n)]


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    llm = LLM(str(checkpoint_dir("mixtral")))
    outs = llm.generate(_prompts(12), _greedy(24), use_tqdm=False)
    return {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(outs)}


def _elastic_llm(checkpoint_dir, **kw) -> LLM:
    return LLM(
        str(checkpoint_dir("mixtral")),
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_elastic_recovery=True,
        **kw,
    )


@pytest.mark.timeout(300)
def test_a_silent_rank_is_restarted_and_every_request_answered_once(checkpoint_dir, reference):
    llm = _elastic_llm(checkpoint_dir, distributed_timeout_s=4.0)
    engine = llm.llm_engine
    stopped = engine._ranks[0].pid
    try:
        prompts = _prompts(12)
        for i in range(6):
            engine.add_request(f"r{i}", prompts[i], _greedy(24))
        got, answered = {}, []
        deadline = time.monotonic() + 180
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the job did not finish: a hang"
            for out in engine.step():
                answered.append(out.request_id)
                got[out.request_id] = out.outputs[0].token_ids
            if len(answered) >= 3 and stopped is not None:
                # a second wave, sent just before the stop, so that some requests are
                # certainly unfinished (the first wave may all finish in one step)
                for i in range(6, 12):
                    engine.add_request(f"r{i}", prompts[i], _greedy(24))
                for rank in engine._ranks:
                    engine._flush(rank)
                os.kill(stopped, signal.SIGSTOP)  # after some results: they must not rerun
                first = list(answered)
                stopped_pid, stopped = stopped, None
        assert sorted(answered) == sorted(reference)  # each exactly once
        assert got == reference
        metrics = llm.get_metrics()
        assert metrics["recoveries"] == 1
        assert 0 < metrics["requests_requeued"] <= 12 - len(first)
        assert metrics["recovery_seconds"] > 0
        assert stopped_pid not in [r.pid for r in engine._ranks]
    finally:
        try:
            os.kill(stopped_pid if stopped is None else stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
        llm.shutdown()


@pytest.mark.timeout(300)
def test_a_ranks_own_error_is_not_retried(checkpoint_dir):
    """A rank that raises (here: a message it does not know) would raise again after a
    restart: the job ends with the error, as without recovery."""
    llm = _elastic_llm(checkpoint_dir)
    engine = llm.llm_engine
    try:
        engine.add_request("a", "hello", _greedy(4))
        engine.rank_set.send(engine._ranks[1], "not a message")
        with pytest.raises(RankFailedError, match="unexpected message") as info:
            _drain(engine, timeout=60)
        assert not info.value.recoverable
        assert engine.recovery.recoveries == 0
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_recovery_gives_up_after_the_restart_budget(checkpoint_dir, monkeypatch):
    monkeypatch.setattr(recovery, "MAX_RECOVERIES", 0)
    llm = _elastic_llm(checkpoint_dir)
    engine = llm.llm_engine
    try:
        # Long enough not to finish before the kill (a step with no request left does not
        # read the ranks, so a finished request would leave the death unseen).
        engine.add_request("a", "hello", _greedy(2000))
        engine.step()
        assert "a" in engine.requests, "the request finished before the kill"
        os.kill(engine._ranks[1].pid, signal.SIGKILL)
        with pytest.raises(RankFailedError, match=r"rank 1 .*SIGKILL.*gave up after 0 restarts"):
            _drain(engine, timeout=60)
    finally:
        llm.shutdown()


@pytest.mark.timeout(400)
def test_batch_run_outlives_a_killed_rank(checkpoint_dir, tmp_path):
    """`batchgen run --enable-elastic-recovery`: a rank SIGKILLed mid-file, the run exits 0
    and the output file holds every custom_id once, the same as one process's."""
    model = str(checkpoint_dir("mixtral"))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _batch_file(src, 40, 48)
    one = _cli("-i", str(src), "-o", str(tmp_path / "one.jsonl"), "--model", model)
    assert one.returncode == 0, one.stderr
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
        "--enable-elastic-recovery",
        "--max-in-flight",
        "8",
    )
    pids = {}
    try:
        pids = _rank_pids(cli, 2)
        _wait_lines(out, 6, cli)
        os.kill(pids[1], signal.SIGKILL)
        _, stderr = cli.communicate(timeout=240)
    finally:
        if cli.poll() is None:
            cli.kill()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert cli.returncode == 0, stderr
    assert "rank 1" in stderr and "SIGKILL" in stderr and "elastic recovery 1 of 3" in stderr
    assert _results(out) == _results(tmp_path / "one.jsonl")  # raises on a duplicate


class _StartFaults:
    """Makes chosen starts of the ranks fail, deterministically: ``plan[i]`` says what happens
    to rank 1 at the i-th start (`start_local_ranks` call): None, it starts; ``"before"``,
    SIGKILLed at once, before it connects; ``"loading"``, SIGKILLed once it has connected and
    been sent its setup (it loads the model); ``"exit"``, replaced by a process that exits with
    code 3 before connecting (an error while starting). Keeps every rank process started."""

    def __init__(self, monkeypatch, plan: list[str | None]) -> None:
        self.plan, self.procs, self.now = list(plan), [], None
        real_start, real_wait = rank_set.start_local_ranks, rank_set.RankSet._wait_ready

        def start(num_local, port, authkey, ranks=None):
            procs = real_start(num_local, port, authkey, ranks)
            self.procs += procs.values()
            self.now = self.plan.pop(0) if self.plan else None
            if self.now in ("before", "exit"):
                procs[1].kill()
                procs[1].wait(10)
            if self.now == "exit":
                code = "raise SystemExit(3)"
                procs[1] = LocalRankProcess(subprocess.Popen([sys.executable, "-c", code]))
                self.procs.append(procs[1])
            return procs

        def wait_ready(rank_set_: rank_set.RankSet, handles):
            if self.now == "loading":
                rank_set_.ranks[1].process.kill()
            return real_wait(rank_set_, handles)

        monkeypatch.setattr(rank_set, "start_local_ranks", start)
        monkeypatch.setattr(rank_set.RankSet, "_wait_ready", wait_ready)

    def running(self, wait: float = 0.0) -> list[int]:
        """Pids of the processes started that still run (after waiting up to ``wait`` s)."""
        return [p.popen.pid for p in self.procs if not p.wait(wait)]


def _recovery_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "elastic recovery " in r.getMessage()]


@pytest.mark.timeout(400)
def test_failed_restarts_are_retried_within_the_budget(
    checkpoint_dir, reference, monkeypatch, caplog
):
    """A rank killed mid-job; the first restart loses rank 1 before it connects, the second
    while it loads the model; the third runs. Every request is answered once with one
    process's tokens, three recoveries are counted, and the half-started ranks are gone."""
    caplog.set_level(logging.WARNING, logger="batchgen.distributed.recovery")
    faults = _StartFaults(monkeypatch, [None, "before", "loading", None])
    llm = _elastic_llm(checkpoint_dir)
    engine = llm.llm_engine
    try:
        # A first wave until some results are in (they must not rerun), then a second wave
        # sent and rank 1 killed at once: the second wave cannot finish before the kill (the
        # requests of one wave finish together, so a kill on results alone may come too late).
        prompts, got, answered = _prompts(12), {}, []
        deadline = time.monotonic() + 300

        def step() -> None:
            assert time.monotonic() < deadline, "the job did not finish: a hang"
            for out in engine.step():
                answered.append(out.request_id)
                got[out.request_id] = out.outputs[0].token_ids

        for i in range(6):
            engine.add_request(f"r{i}", prompts[i], _greedy(24))
        while len(answered) < 3:
            step()
        for i in range(6, 12):
            engine.add_request(f"r{i}", prompts[i], _greedy(24))
        for rank in engine._ranks:
            engine._flush(rank)
        first = list(answered)
        os.kill(engine._ranks[1].pid, signal.SIGKILL)
        while engine.has_unfinished_requests():
            step()
        assert sorted(answered) == sorted(reference)  # each exactly once
        assert got == reference
        metrics = llm.get_metrics()
        assert metrics["recoveries"] == 3
        assert 6 <= metrics["requests_requeued"] <= 12 - len(first)  # once, not per restart
        assert metrics["recovery_seconds"] > 0
        lines = _recovery_lines(caplog)
        for k in (1, 2, 3):
            assert any(f"elastic recovery {k} of 3" in line for line in lines), lines
        assert any("SIGKILL before connecting; elastic recovery 2 of 3" in x for x in lines)
        assert any(re.search("died: killed by SIGKILL.*elastic recovery 3 of 3", x) for x in lines)
        assert sorted(faults.running()) == sorted(r.pid for r in engine._ranks)  # no orphan
    finally:
        llm.shutdown()
    assert faults.running(wait=10) == []


@pytest.mark.timeout(300)
def test_a_rank_killed_during_the_first_start_is_retried(
    checkpoint_dir, reference, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger="batchgen.distributed.recovery")
    faults = _StartFaults(monkeypatch, ["before"])
    llm = _elastic_llm(checkpoint_dir)
    try:
        outs = llm.generate(_prompts(3), _greedy(24), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [reference[f"r{i}"] for i in range(3)]
        metrics = llm.get_metrics()
        assert (metrics["recoveries"], metrics["requests_requeued"]) == (1, 0)
        lines = _recovery_lines(caplog)
        assert any("before connecting; elastic recovery 1 of 3" in x for x in lines), lines
    finally:
        llm.shutdown()
    assert faults.running(wait=10) == []


@pytest.mark.timeout(300)
def test_a_ranks_exit_code_while_starting_is_not_retried(checkpoint_dir, monkeypatch, caplog):
    """An exit with an error code while starting (a bad model, a missing package) would repeat:
    the start fails at once, recovery or not."""
    caplog.set_level(logging.WARNING, logger="batchgen.distributed.recovery")
    faults = _StartFaults(monkeypatch, ["exit"])
    pattern = "rank 1 .*exited with code 3 before connecting"
    with pytest.raises(RankFailedError, match=pattern) as info:
        _elastic_llm(checkpoint_dir)
    assert not info.value.recoverable
    assert _recovery_lines(caplog) == []
    assert faults.running() == []


@pytest.mark.timeout(300)
def test_recovery_gives_up_when_the_restarts_keep_failing(checkpoint_dir, monkeypatch):
    """The budget spent on failed restarts: the documented error, raised again by every later
    call (no restart beyond the budget), and no rank process left."""
    monkeypatch.setattr(recovery, "MAX_RECOVERIES", 1)
    faults = _StartFaults(monkeypatch, [None, "loading"])
    llm = _elastic_llm(checkpoint_dir)
    engine = llm.llm_engine
    try:
        # Long enough not to finish before the kill (a step with no request left does not
        # read the ranks, so a finished request would leave the death unseen).
        engine.add_request("a", "hello", _greedy(2000))
        engine.step()
        assert "a" in engine.requests, "the request finished before the kill"
        os.kill(engine._ranks[1].pid, signal.SIGKILL)
        pattern = r"rank 1 .*died: killed by SIGKILL.*gave up after 1 restarts"
        with pytest.raises(RankFailedError, match=pattern) as info:
            _drain(engine, timeout=120)
        assert faults.running() == []
        with pytest.raises(RankFailedError) as again:
            engine.step()
        assert again.value is info.value
        assert engine.recovery.recoveries == 1 and faults.plan == []
    finally:
        llm.shutdown()
    assert faults.running(wait=10) == []
