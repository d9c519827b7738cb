"""`batchgen run` and signals, in process or in a small subprocess, without a model: the orderly
stop on SIGINT / SIGTERM (`batchgen.entrypoints.cli_signals`), a second signal during it, and
a signal after the command finished. The same with the real engine is in test_cli_e2e.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from batchgen.entrypoints import cli

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
os.kill(os.getpid(), signal.SIGTERM)  # what a supervisor sends as the job ends
time.sleep(5)
print("after sleep", flush=True)
"""


@pytest.mark.parametrize("code", [0, 2])
def test_sigterm_after_a_finished_run_exits_with_the_runs_code(code):
    """The ``batchgen`` script: a SIGTERM that lands after `batchgen run` finished (while the
    interpreter shuts down) exits with the run's own code at once, not 143 or death by signal;
    an in-process caller gets its previous handler back (here the default: death by SIGTERM)."""
    entry = subprocess.run(
        [sys.executable, "-c", _AFTER_THE_JOB, str(code), "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert entry.returncode == code, entry.stderr
    assert entry.stdout == f"returned {code}\n" and "summary" in entry.stderr
    in_process = subprocess.run(
        [sys.executable, "-c", _AFTER_THE_JOB, str(code), "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert in_process.returncode == -15 and in_process.stdout == f"returned {code}\n"


def test_run_turns_sigterm_into_an_orderly_stop_unless_the_parent_ignores_it(capsys):
    """`batchgen run` raises `cli.Terminated` on SIGTERM (exit 143, a line on stderr) and puts
    the previous handler back; a SIGTERM ignored on entry (SIG_IGN from the parent) stays
    ignored, as Python leaves an ignored SIGINT and POSIX shells an ignored trap."""
    import argparse
    import os
    import signal

    from batchgen.entrypoints.cli_flags import Subcommand

    def kill_self(args):
        os.kill(os.getpid(), signal.SIGTERM)
        return 0

    run = Subcommand("run", "", lambda p: None, kill_self, uses_torch=False)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        signal.signal(signal.SIGTERM, lambda *a: None)
        handler = signal.getsignal(signal.SIGTERM)
        assert cli._run_command(run, argparse.Namespace()) == 143
        assert "batchgen run: terminated by SIGTERM (rerun with --resume" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is handler
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        assert cli._run_command(run, argparse.Namespace()) == 0  # still running: ignored
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def _signal_run(body):
    """`_run_command` on a ``run`` whose work is ``body()`` (it sends signals to itself),
    with SIGINT and SIGTERM at Python's defaults around it; returns (code, stderr) and
    checks that both handlers were put back."""
    import argparse
    import os
    import signal

    from batchgen.entrypoints.cli_flags import Subcommand

    run = Subcommand("run", "", lambda p: None, lambda args: body(os, signal), uses_torch=False)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        code = cli._run_command(run, argparse.Namespace())
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def test_a_second_signal_does_not_break_into_the_orderly_stop(capsys):
    """SIGTERM, then SIGINT while the run unwinds (writing what it finished): the unwind runs
    to its end and the run exits 143, with one line and no traceback."""
    unwound = []

    def body(os, signal):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        finally:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the SIGINT's handler runs here
            unwound.append("done")
        return 0

    assert _signal_run(body) == 143
    assert unwound == ["done"]
    assert capsys.readouterr().err == (
        "batchgen run: terminated by SIGTERM (rerun with --resume to continue)\n"
    )


def test_signals_that_land_together_exit_143_if_one_is_sigterm(capsys):
    """SIGTERM and SIGINT pending at once (both sent during one long C call) reach Python
    SIGINT first; the SIGTERM among them still makes the stop a termination."""

    def body(os, signal):
        both = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, both)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, both)
        time.sleep(5)
        return 0

    assert _signal_run(body) == 143
    assert capsys.readouterr().err == (
        "batchgen run: terminated by SIGTERM (rerun with --resume to continue)\n"
    )
