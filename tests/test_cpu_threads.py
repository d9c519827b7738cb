"""`batchgen.engine.cpu_threads`: threads from the affinity mask and cgroup quota, the OpenMP
wait policy (never over the user's choice), the once-only oversubscription warning."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from batchgen.engine import cpu_threads as ct


@pytest.fixture
def fresh(monkeypatch):
    """Module state and torch's thread count restored after the test; no user variables."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(ct, "_configured", None)
    monkeypatch.setattr(ct, "_warned_oversubscribed", False)
    for name in ("OMP_NUM_THREADS", *ct.WAIT_POLICY_VARS):
        monkeypatch.delenv(name, raising=False)
    yield
    torch.set_num_threads(threads)


def test_available_cpus_is_the_affinity_mask_capped_by_the_cgroup_quota(tmp_path):
    mask = len(os.sched_getaffinity(0))
    assert ct.available_cpus(tmp_path) == mask  # no cpu.max: the mask
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert ct.available_cpus(tmp_path) == mask
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: one thread
    assert ct.available_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("6400000 100000\n")  # 64 CPUs of quota: the mask rules
    assert ct.available_cpus(tmp_path) == mask


def test_wait_policy_follows_the_load_and_never_overrides_the_user():
    env: dict = {}
    assert ct.set_openmp_wait_policy(env, load=0.3) == {"GOMP_SPINCOUNT": "10000"}  # idle
    assert env == {"GOMP_SPINCOUNT": "10000"}
    for load in (1.0, 3.5):  # another process is running: sleep at once
        env = {}
        assert ct.set_openmp_wait_policy(env, load=load) == {"OMP_WAIT_POLICY": "PASSIVE"}
        assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for name, value in (
        ("OMP_WAIT_POLICY", "ACTIVE"),
        ("GOMP_SPINCOUNT", "300000"),
        ("KMP_BLOCKTIME", "200"),
    ):
        env = {name: value}
        assert ct.set_openmp_wait_policy(env, load=5.0) == {} and env == {name: value}


def test_running_tasks_is_the_median_run_queue_less_the_reader(tmp_path):
    f = tmp_path / "loadavg"
    f.write_text("3.10 2.50 1.90 1/87 30159\n")  # only the reader runs: idle, whatever the average
    assert ct.running_tasks(f, samples=3, interval_s=0, own=lambda: 1) == 0
    f.write_text("0.20 0.10 0.05 3/87 30159\n")
    assert ct.running_tasks(f, samples=1, interval_s=0, own=lambda: 1) == 2
    # this process's own busy threads (2 of the 3) are not other processes' tasks
    assert ct.running_tasks(f, samples=1, interval_s=0, own=lambda: 2) == 1
    assert ct.running_tasks(tmp_path / "missing", samples=2, interval_s=0) is None
    f.write_text("garbage\n")
    assert ct.running_tasks(f, samples=1, interval_s=0) is None


def test_wait_policy_follows_the_run_queue_not_the_load_average(monkeypatch):
    # After an earlier job the 1-minute average stays high on an idle machine: the run queue
    # decides. Another task running now: sleep at once.
    spin, sleep = {"GOMP_SPINCOUNT": "10000"}, {"OMP_WAIT_POLICY": "PASSIVE"}
    assert ct.set_openmp_wait_policy({}, load=3.0, running=0) == spin
    assert ct.set_openmp_wait_policy({}, load=0.1, running=1) == sleep
    monkeypatch.setattr(ct, "running_tasks", lambda: 0)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.5, 2.0, 1.0))
    assert ct.set_openmp_wait_policy({}) == spin
    monkeypatch.setattr(ct, "running_tasks", lambda: None)  # no /proc/loadavg: the average
    assert ct.set_openmp_wait_policy({}) == sleep
    assert ct.set_openmp_wait_policy({"KMP_BLOCKTIME": "5"}, running=0) == {}


def test_threads_are_the_cpus_divided_among_local_processes(fresh, monkeypatch, caplog):
    monkeypatch.setattr(ct, "available_cpus", lambda: 8)
    with caplog.at_level(logging.INFO, logger="batchgen.engine.cpu_threads"):
        assert ct.configure_cpu_threads(4) == 2
    assert torch.get_num_threads() == 2
    assert "CPU threads: 2 (8 CPUs available / 4 local process(es))" in caplog.text
    assert ct.configure_cpu_threads() == 2  # the engine's call keeps a launcher's choice
    assert ct.configure_cpu_threads(1) == 8 and torch.get_num_threads() == 8
    assert ct.configure_cpu_threads(16) == 1  # never 0
    with pytest.raises(ValueError, match="num_local_processes must be >= 1, got 0"):
        ct.configure_cpu_threads(0)


def test_omp_num_threads_from_the_user_wins(fresh, monkeypatch, caplog):
    monkeypatch.setattr(ct, "available_cpus", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    with caplog.at_level(logging.INFO, logger="batchgen.engine.cpu_threads"):
        assert ct.configure_cpu_threads(2) == 3
    assert torch.get_num_threads() == 3
    assert "CPU threads: 3 (OMP_NUM_THREADS); OpenMP wait policy: GOMP_SPINCOUNT=1000" in (
        caplog.text
    )


def test_oversubscription_is_warned_once(fresh, caplog):
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.cpu_threads"):
        assert not ct.warn_if_oversubscribed(cpus=2, load=1.5)
        assert ct.warn_if_oversubscribed(cpus=2, load=3.2)
        assert not ct.warn_if_oversubscribed(cpus=2, load=9.0)  # once per process
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "load average 3.2 over the last minute on 2 CPU(s)" in warnings[0]
    assert "OMP_NUM_THREADS" in warnings[0]


def test_own_running_threads_reads_each_threads_state(tmp_path):
    for tid, stat in [
        ("10", "10 (python) R 1 10 10 0"),
        ("11", "11 (odd ) S name) R 1 10"),  # the state follows the last ")"
        ("12", "12 (torch) S 1 10 10 0"),
    ]:
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "stat").write_text(stat)
    assert ct.own_running_threads(tmp_path) == 2
    assert ct.own_running_threads(tmp_path / "missing") == 1  # at least the caller
    assert ct.own_running_threads() >= 1  # this process, for real


def test_the_busy_warning_follows_other_processes_running_now_not_a_stale_average(
    fresh, monkeypatch, caplog
):
    """Before: the warning fired whenever the 1-minute load average reached the CPUs, which
    it does for a minute or two after any earlier run on an idle 2-CPU machine (and with this
    process's own start-up work)."""
    import subprocess
    import sys
    import time

    monkeypatch.setattr(os, "getloadavg", lambda: (2.6, 2.2, 1.5))  # stale: an earlier run
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.cpu_threads"):
        assert not ct.warn_if_oversubscribed(cpus=2, running=0)
        assert not ct.warn_if_oversubscribed(cpus=2, running=1)
        # Two other processes keep both CPUs busy now: warned, by the run queue.
        spin = [sys.executable, "-c", "while True: pass"]
        procs = [subprocess.Popen(spin) for _ in range(2)]
        try:
            time.sleep(0.3)
            assert ct.running_tasks() >= 2
            assert ct.warn_if_oversubscribed(cpus=2)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("the machine is busy: ")
    assert "task(s) of other processes running now on 2 CPU(s)" in warning


def test_omp_num_threads_list_takes_its_outer_level_and_garbage_is_an_error(fresh, monkeypatch):
    """OpenMP's syntax is a list of levels (``4,2``: 4 threads at the outer level), which
    libgomp honours; it was ignored here (not all digits) and ``cpus // N`` used instead. A
    value that is no such list (``four``, ``0``, ``-2``) names the variable and its form
    instead of silently running another thread count."""
    monkeypatch.setattr(ct, "available_cpus", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", " 3,2 ")
    assert ct.configure_cpu_threads(2) == 3 and torch.get_num_threads() == 3
    for bad in ("four", "0", "-2", "3,,2", "2.5"):
        monkeypatch.setattr(ct, "_configured", None)
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match=r"OMP_NUM_THREADS=.*positive int"):
            ct.configure_cpu_threads(2)
    monkeypatch.setattr(ct, "_configured", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "  ")  # blank: unset
    assert ct.configure_cpu_threads(2) == 4
