"""`batchgen run` and signals with the real engine, in subprocesses: SIGHUP ignored under
``nohup``, SIGHUP from a terminal that closed (its stderr gone), and a SIGTERM to the whole
process group while a data-parallel run's ranks shut down after the last result. Every case
has a timeout and kills what it started. SIGTERM / SIGHUP / SIGKILL mid-run then ``--resume``
is `test_cli_e2e.test_kill_then_resume_gives_each_custom_id_once`."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import test_cli_e2e
from test_cli_e2e import BATCHGEN, _completion, _env, _lines

IDS = [f"req-{i:03d}" for i in range(40)]
# The first results of a module's first run wait for the kernels to compile into its fresh
# cache (about a minute on 2 quiet cores, several on a busy machine).
FIRST_RESULTS_S = 300
tiny_model = test_cli_e2e.tiny_model  # the fixture: a tiny Mixtral checkpoint


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The subprocesses' environment, with one cache dir: the kernels compile into it once."""
    return _env(tmp_path_factory.mktemp("cache"))


def _write_input(path: Path) -> None:
    path.write_text(
        "".join(
            _completion(c, f"prompt number {i} " * (1 + i % 7), max_tokens=48, ignore_eos=True)
            + "\n"
            for i, c in enumerate(IDS)
        )
    )


def _wait_for_results(out: Path, count: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{out} never held {count} results (exit {proc.poll()})")


def _stop(proc: subprocess.Popen) -> None:
    """Kill ``proc`` (and its process group when it leads one) if it still runs."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (PermissionError, ProcessLookupError):
            proc.kill()
        proc.wait(30)


def test_nohup_keeps_sighup_ignored_and_the_run_finishes(tmp_path, tiny_model, env):
    """Under ``nohup`` (SIGHUP ignored on entry) a SIGHUP mid-run changes nothing: exit 0,
    every result."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp)
    args = ["--model", tiny_model, "--no-progress", "--max-in-flight", "4"]
    proc = subprocess.Popen(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(out), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # what nohup does
    )
    try:
        _wait_for_results(out, 6, proc, FIRST_RESULTS_S)
        proc.send_signal(signal.SIGHUP)
        _, stderr = proc.communicate(timeout=180)
    finally:
        _stop(proc)
    assert proc.returncode == 0, stderr
    assert sorted(r["custom_id"] for r in _lines(out)) == IDS
    assert "SIGHUP" not in stderr


def test_sighup_from_a_closed_terminal_keeps_every_finished_result(tmp_path, tiny_model, env):
    """An ssh session dropped without ``nohup``: the terminal (stderr, where the progress bar
    draws) is gone, so every write to it fails (EIO), and SIGHUP arrives. The run stops in
    order all the same: exit 129, every line whole, no result twice; ``--resume`` finishes
    the rest."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp)
    args = ["--model", tiny_model, "--max-in-flight", "4"]  # with the progress bar
    master, slave = pty.openpty()
    drained = threading.Thread(target=_drain, args=(master,), daemon=True)
    proc = subprocess.Popen(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(out), *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    drained.start()
    try:
        _wait_for_results(out, 6, proc, FIRST_RESULTS_S)
        os.close(master)  # the terminal goes away: writes to it fail from now on
        proc.send_signal(signal.SIGHUP)
        proc.wait(120)
    finally:
        _stop(proc)
    assert proc.returncode == 129
    results = _lines(out)  # every line whole
    kept = len(results)
    assert 6 <= kept < 40, "the hang-up should land mid-run"
    assert len({r["custom_id"] for r in results}) == kept
    assert all(r["error"] is None for r in results)
    subprocess.run(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(out), "--resume", "--no-progress", *args],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert sorted(r["custom_id"] for r in _lines(out)) == IDS


def _drain(fd: int) -> None:
    """Read the terminal's output until it closes (a full pty would block the writer)."""
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass


# The frontend of `batchgen run -dp 2`: its ranks' shutdown (after the last result) is slowed
# by a second, and ``marker`` is written as it starts, so the test's signal lands inside it.
_DP_FRONTEND = """
import sys, time
from pathlib import Path
from batchgen.distributed import rank_set

marker = Path(sys.argv[1])
shutdown = rank_set.RankSet.shutdown

def slow_shutdown(self, timeout=30.0):
    get = self._inbox.get

    def first_get(*args, **kwargs):  # Shutdown is sent to every rank; they are leaving
        self._inbox.get = get
        marker.write_text("shutting down")
        time.sleep(1.0)
        return get(*args, **kwargs)

    self._inbox.get = first_get
    return shutdown(self, timeout)

rank_set.RankSet.shutdown = slow_shutdown
from batchgen.entrypoints import cli

sys.argv = ["batchgen", *sys.argv[2:]]
sys.exit(cli.main())
"""


@pytest.mark.timeout(400)
def test_dp_sigterm_while_the_ranks_shut_down_keeps_exit_0(tmp_path, tiny_model, env):
    """``-dp 2``: a SIGTERM to the whole process group (``timeout``, a container stop, a
    supervisor) while the ranks shut down after the last result was written: the run's work
    is done, so it still exits 0 with every result and its summary; the signal is only noted.
    The ranks, which get it too, leave; none is left behind."""
    import psutil

    inp, out, marker = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "marker"
    _write_input(inp)
    argv = ["run", "-i", str(inp), "-o", str(out), "--model", tiny_model, "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _DP_FRONTEND, str(marker), *argv, "-dp", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, the ranks in it: not pytest
    )
    children: list[psutil.Process] = []
    try:
        deadline = time.time() + 300
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            children = psutil.Process(proc.pid).children(recursive=True) or children
            time.sleep(0.05)
        assert marker.exists(), f"the shutdown never started (exit {proc.poll()})"
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode == 0, stderr
    assert sorted(r["custom_id"] for r in _lines(out)) == IDS
    assert all(r["error"] is None for r in _lines(out))
    assert f"results in {out}" in stderr
    assert "batchgen run: SIGTERM received once the work was done: ignored (exit code 0)" in (
        stderr
    )
    assert "Traceback" not in stderr and "terminated by" not in stderr, stderr
    assert children, "the ranks were never seen"
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]
