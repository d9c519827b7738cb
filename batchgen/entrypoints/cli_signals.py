"""Signals during ``batchgen run``: the orderly stop (`OrderlyStop`) and its exit codes.

A run stopped by a signal writes the results it finished, shuts the engine and its ranks down
and exits 128 + the signal's number, as shells report a process a signal ended:

==========  ==========================================  ====  ==========================
signal      sent by                                     exit  line on stderr
==========  ==========================================  ====  ==========================
SIGINT      Ctrl-C                                      130   ``interrupted``
SIGTERM     ``kill``, ``timeout``, container runtimes   143   ``terminated by SIGTERM``
SIGHUP      the terminal closing (an ssh session        129   ``terminated by SIGHUP``
            dropped without ``nohup`` / tmux)
==========  ==========================================  ====  ==========================

The rules, each for a way the stop used to go wrong:

- **Installed first.** `_run_command` installs the handlers before any start-up work (the
  OpenMP probe alone takes 200 ms): a signal then no longer killed the process outright.
- **One stop.** The first signal raises (`KeyboardInterrupt` for SIGINT, `Terminated`
  otherwise); a later one is only noted, since raised inside the stop it would cut it short
  (a traceback, the kept-results line lost). SIGKILL still ends the process at once. The
  code is that of the first signal other than SIGINT, else 130: signals pending together
  reach Python in number order (SIGHUP, SIGINT, SIGTERM), the second one at whatever moment
  Python next checks, so `OrderlyStop.exit_signal` runs pending handlers before it decides.
- **Work done is done.** Once the command's work is done (`work_done`: for ``run``, every
  result written and synced) a signal is only noted: the rest (the ranks' shutdown, the
  summary) runs to its end, the command's own exit code stands, and one line says the signal
  came too late to stop anything.
- **Ignored stays ignored.** A signal ignored on entry (SIG_IGN from the parent: ``nohup``
  ignores SIGHUP) stays ignored, as Python leaves an ignored SIGINT and POSIX shells an
  ignored trap; a SIGINT handler other than Python's own is left alone.
- **After the command.** The ``batchgen`` script exits at once with the command's code on a
  signal (`exit_now`) and ignores them while the interpreter exits; in-process callers get
  their handlers back (`OrderlyStop.uninstall`).

A terminal that closed takes stderr with it: `say` drops a line it cannot write, so the stop
still ends with its exit code rather than an OSError.
"""

from __future__ import annotations

import atexit
import contextvars
import os
import signal
import sys

from batchgen.entrypoints.cli_flags import PROG

# Handled in this order (signal numbers: 1, 2, 15).
STOP_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a command: unwinds like Ctrl-C (the results finished so far
    are written, the engine and its ranks shut down), then the command exits 128 + ``signum``
    (143 for SIGTERM, 129 for SIGHUP)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signal.Signals(signum)


_ACTIVE: contextvars.ContextVar[OrderlyStop | None] = contextvars.ContextVar(
    "batchgen_orderly_stop", default=None
)


def work_done() -> None:
    """Mark the running command's work as done: from now on a stop signal is only noted and
    the command's own exit code stands (no-op outside an installed `OrderlyStop`)."""
    stop = _ACTIVE.get()
    if stop is not None:
        stop.finish()


def say(line: str) -> None:
    """Print ``line`` to stderr; a stderr that is gone (a closed terminal: EIO; a closed
    stream) drops it instead of raising."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def run_pending_handlers() -> None:
    """Run the Python handlers of signals that have arrived but not run yet (`pthread_sigmask`
    checks for them on its way out; blocking no signal changes nothing else)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, ())


def stop_line(command: str, signum: int, kept: str, hint: str) -> str:
    """The line a command stopped by ``signum`` prints: ``batchgen run: terminated by
    SIGTERM; 12 results written by this run in out.jsonl (rerun with --resume to continue)``
    (``kept``: what is on disk, "" for nothing; ``hint``: appended as it is)."""
    name = signal.Signals(signum).name
    how = "interrupted" if signum == signal.SIGINT else f"terminated by {name}"
    return f"{PROG} {command}: {how}{'; ' + kept if kept else ''}{hint}"


class OrderlyStop:
    """The stop signals' handlers during one command (see the module docstring).

    ``received``: the signals that reached the handler before the work was done, in order;
    ``late``: those after (`finish`), only noted.
    """

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self.late: list[signal.Signals] = []
        self.previous: dict[int, object] = {}
        self.done = False
        self._armed = False  # the next signal raises
        self._token: contextvars.Token | None = None

    def install(self) -> None:
        """Take over SIGHUP, SIGINT and SIGTERM (not one ignored on entry, nor a SIGINT
        handler other than Python's own). Main thread only (`signal.signal`'s rule)."""
        self._token = _ACTIVE.set(self)
        self._armed = True
        for sig in STOP_SIGNALS:
            current = signal.getsignal(sig)
            if current is signal.SIG_IGN or (
                sig == signal.SIGINT and current is not signal.default_int_handler
            ):
                continue
            self.previous[sig] = current  # first: a signal as the handler goes in is put back
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        sig = signal.Signals(signum)
        if self.done:
            self.late.append(sig)
            return
        self.received.append(sig)
        if self._armed:
            self._armed = False
            raise KeyboardInterrupt() if sig == signal.SIGINT else Terminated(sig)

    def finish(self) -> None:
        """The command's work is done: a signal from now on is only noted (`late`), one
        already pending included."""
        self.done = True
        if self._token is not None:  # installed: its handlers, not Python's defaults, run
            run_pending_handlers()

    def exit_signal(self, err: BaseException) -> signal.Signals:
        """The signal the stop exits by: the first received other than SIGINT (signals that
        landed together count, their handlers run first), else SIGINT."""
        self._armed = False
        if self._token is not None:
            run_pending_handlers()
        first = next((s for s in self.received if s != signal.SIGINT), None)
        if first is None and isinstance(err, Terminated):
            first = err.signum
        return first or signal.SIGINT

    def late_line(self, command: str, code: int) -> str:
        """What to say of the `late` signals ("" when none)."""
        if not self.late:
            return ""
        names = ", ".join(dict.fromkeys(s.name for s in self.late))
        return (
            f"{PROG} {command}: {names} received once the work was done: ignored (exit code {code})"
        )

    def uninstall(self, code: int, process_entry: bool) -> None:
        """After the command: the ``batchgen`` script exits at once with ``code`` on any stop
        signal (`exit_now`), and ignores them once the interpreter exits (which puts Python's
        handlers back to SIG_DFL before it tears down the modules: a signal then killed the
        process, exit -2 or -15, not ``code``); in-process callers get their handlers back."""
        for sig, previous in self.previous.items():
            if process_entry:
                signal.signal(sig, exit_now(code))
            else:  # None: a handler from outside Python, which only SIG_DFL can stand for
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        if process_entry and self.previous:
            atexit.register(ignore_signals, list(self.previous))
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None


def exit_now(code: int):
    """A signal handler for after the command has finished: the process exits at once with
    the command's own exit code (a finished job stays a success) instead of dying of the
    signal, or printing a KeyboardInterrupt traceback, while the interpreter shuts down."""

    def handler(signum, frame) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:  # a closed terminal, or the stream mid-write in this thread
                stream.flush()
            except Exception:
                pass
        os._exit(code)

    return handler


def ignore_signals(signals: list[int]) -> None:
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
