"""`batchgen run` and signals, in process or in a small subprocess, without a model: the orderly
stop on SIGINT / SIGTERM / SIGHUP (`batchgen.entrypoints.cli_signals`) from the first moment of
the command, a second signal during it, a signal once the work is done, and one after the
command finished. The same with the real engine is in test_cli_signals_e2e.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_batch_runner import FakeEngine, completion_line, write_lines

from batchgen.engine import cpu_threads
from batchgen.entrypoints import batch_runner, cli, cli_flags
from batchgen.entrypoints.cli_flags import Subcommand

STOP_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
# signal -> (exit code, what the line on stderr says)
STOPS = {
    "SIGINT": (130, "interrupted"),
    "SIGTERM": (143, "terminated by SIGTERM"),
    "SIGHUP": (129, "terminated by SIGHUP"),
}
HINT = "(rerun with --resume to continue)"


@contextlib.contextmanager
def _default_handlers():
    """SIGHUP, SIGINT and SIGTERM at Python's defaults for the block; checks that the command
    put them back, then restores pytest's."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    try:
        yield
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_AFTER_THE_JOB = """
import os, signal, sys, time
from types import SimpleNamespace
from batchgen.entrypoints import cli

class Run:  # a finished `batchgen run`
    name, uses_torch = "run", False
    def run(self, args):
        print("summary", file=sys.stderr)
        return int(sys.argv[1])

code = cli._run_command(Run(), SimpleNamespace(), process_entry=sys.argv[2] == "1")
print("returned", code, flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[3]))  # a supervisor, a closed terminal
time.sleep(5)
print("after sleep", flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("code", [0, 2])
def test_a_signal_after_a_finished_run_exits_with_the_runs_code(code, sig):
    """The ``batchgen`` script: a SIGTERM or SIGHUP that lands after `batchgen run` finished
    (while the interpreter shuts down) exits with the run's own code at once, not 143 / 129 or
    death by signal; an in-process caller gets its previous handler back (here the default:
    death by the signal)."""
    entry = subprocess.run(
        [sys.executable, "-c", _AFTER_THE_JOB, str(code), "1", sig],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert entry.returncode == code, entry.stderr
    assert entry.stdout == f"returned {code}\n" and "summary" in entry.stderr
    in_process = subprocess.run(
        [sys.executable, "-c", _AFTER_THE_JOB, str(code), "0", sig],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert in_process.returncode == -getattr(signal, sig)
    assert in_process.stdout == f"returned {code}\n"


_AT_START_UP = """
import os, signal, sys, time
from batchgen.engine import cpu_threads

SIG = getattr(signal, sys.argv[1])

def probe():  # the OpenMP probe samples the run queue for 200 ms: the signal lands in it
    os.kill(os.getpid(), SIG)
    time.sleep(5)
    print("probe slept", flush=True)

cpu_threads.set_openmp_wait_policy = probe
from batchgen.entrypoints import cli

sys.argv = ["batchgen", "run", "-i", sys.argv[2], "-o", sys.argv[3]]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("sig", list(STOPS))
def test_a_signal_during_start_up_is_an_orderly_stop(tmp_path, sig):
    """A signal in the command's first moments (the OpenMP wait-policy probe runs for 200 ms
    before the model loads) stops the run in order, as later: the usual line and exit code,
    no traceback, no death by the signal (exit -15 / -1 before the handlers were installed
    first), and no output file, since nothing ran."""
    code, how = STOPS[sig]
    write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", _AT_START_UP, sig, str(tmp_path / "in.jsonl"), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == code, proc.stderr
    assert proc.stderr == f"batchgen run: {how} {HINT}\n"
    assert proc.stdout == "" and not out.exists()


def _signal_run(body) -> int:
    """`_run_command` on a ``run`` whose work is ``body(os, signal)`` (it sends signals to
    itself), with the stop signals at Python's defaults around it; returns the exit code and
    checks that the handlers were put back."""
    run = Subcommand("run", "", lambda p: None, lambda args: body(os, signal), uses_torch=False)
    with _default_handlers():
        return cli._run_command(run, argparse.Namespace())


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_run_turns_a_signal_into_an_orderly_stop_unless_the_parent_ignores_it(capsys, sig):
    """`batchgen run` raises `cli.Terminated` on SIGTERM or SIGHUP (exit 128 + the signal's
    number, a line on stderr) and puts the previous handler back; a signal ignored on entry
    (SIG_IGN from the parent: ``nohup`` ignores SIGHUP) stays ignored, as Python leaves an
    ignored SIGINT and POSIX shells an ignored trap."""
    signum = getattr(signal, sig)
    code, how = STOPS[sig]

    def kill_self(args):
        os.kill(os.getpid(), signum)
        return 0

    run = Subcommand("run", "", lambda p: None, kill_self, uses_torch=False)
    previous = signal.signal(signum, signal.SIG_DFL)
    try:
        signal.signal(signum, lambda *a: None)
        handler = signal.getsignal(signum)
        assert cli._run_command(run, argparse.Namespace()) == code
        assert capsys.readouterr().err == f"batchgen run: {how} {HINT}\n"
        assert signal.getsignal(signum) is handler
        signal.signal(signum, signal.SIG_IGN)
        assert cli._run_command(run, argparse.Namespace()) == 0  # still running: ignored
        assert signal.getsignal(signum) is signal.SIG_IGN
        assert capsys.readouterr().err == ""
    finally:
        signal.signal(signum, previous)


@pytest.mark.parametrize("first", ["SIGTERM", "SIGHUP"])
def test_a_second_signal_does_not_break_into_the_orderly_stop(capsys, first):
    """SIGTERM (or SIGHUP), then SIGINT while the run unwinds (writing what it finished): the
    unwind runs to its end and the run exits with the first signal's code, with one line and
    no traceback."""
    unwound = []
    code, how = STOPS[first]

    def body(os, signal):
        try:
            os.kill(os.getpid(), getattr(signal, first))
            time.sleep(5)  # the handler raises before this ends
        finally:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the SIGINT's handler runs here
            unwound.append("done")
        return 0

    assert _signal_run(body) == code
    assert unwound == ["done"]
    assert capsys.readouterr().err == f"batchgen run: {how} {HINT}\n"


@pytest.mark.parametrize("other", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("attempt", range(5))  # it depended on when Python ran the 2nd handler
def test_signals_that_land_together_exit_as_the_one_that_is_not_sigint(capsys, other, attempt):
    """SIGTERM (or SIGHUP) and SIGINT pending at once (both sent during one long C call): the
    handlers run in signal-number order once the call returns, the second one whenever Python
    next checks (after the stop's exit code was chosen, in about half the runs before: exit
    130). The SIGTERM or SIGHUP among them makes the stop a termination, every time."""
    code, how = STOPS[other]

    def body(os, signal):
        both = {signal.SIGINT, getattr(signal, other)}
        signal.pthread_sigmask(signal.SIG_BLOCK, both)
        try:
            os.kill(os.getpid(), getattr(signal, other))
            os.kill(os.getpid(), signal.SIGINT)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, both)
        time.sleep(5)
        return 0

    assert _signal_run(body) == code
    assert capsys.readouterr().err == f"batchgen run: {how} {HINT}\n"


@pytest.mark.parametrize("sig", list(STOPS))
@pytest.mark.parametrize("where", ["note_prefix_cache", "shutdown_engine"])
def test_a_signal_once_every_result_is_written_keeps_the_runs_exit_code(
    tmp_path, monkeypatch, capsys, sig, where
):
    """A signal that lands once every result is written (``note_prefix_cache``: the output
    closed and synced, `run_batch_file` about to return; ``shutdown_engine``: the engine and
    its ranks stopping) does not turn the finished run into an interrupted one: exit 0, the
    summary line, every result, and one line that says the signal came too late to stop
    anything, no "terminated" / "interrupted" line and no traceback."""
    write_lines(tmp_path / "in.jsonl", [completion_line(c) for c in "abc"])
    out = tmp_path / "out.jsonl"
    sent = []

    def signal_now(original):
        def step(*args, **kwargs):
            os.kill(os.getpid(), getattr(signal, sig))
            time.sleep(0.05)  # the handler runs by here
            sent.append(sig)
            return original(*args, **kwargs)

        return step

    monkeypatch.setattr(cpu_threads, "set_openmp_wait_policy", lambda: None)
    monkeypatch.setattr(cli_flags, "start_engine", lambda kwargs: FakeEngine())
    module = batch_runner if where == "note_prefix_cache" else cli_flags
    monkeypatch.setattr(module, where, signal_now(getattr(module, where)))
    argv = ["run", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--no-progress"]
    with _default_handlers():
        code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 0, err
    assert sent == [sig]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == ["a", "b", "c"]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results)
    assert f"results in {out}" in err
    assert f"batchgen run: {sig} received once the work was done: ignored (exit code 0)" in err
    assert "terminated" not in err and "interrupted" not in err and "Traceback" not in err
