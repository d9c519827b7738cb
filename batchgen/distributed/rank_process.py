"""A rank the frontend started, whatever started it: a process on this machine (the ``mp``
executor, here) or a Ray actor (`batchgen.distributed.ray_executor`).

`RankSet` only asks five things of one, so its failure reports and its shutdown read the same
for both: has it ended (`done`), how (`describe`), was it lost rather than exiting by itself
(`killed`), stop it (`kill`), wait for it (`wait`).
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Protocol

from batchgen.distributed.launch import AUTHKEY_ENV, rank_command


class RankProcess(Protocol):
    """What the frontend holds of a rank it started.

    ``name``: how messages name it (``pid 1234``, ``Ray actor 5f3e9a1c``); ``pid``: its
    process id, 0 where the launcher does not know it (a Ray actor, until it connects).
    """

    name: str
    pid: int

    def done(self) -> bool:
        """True once the rank has ended (never blocks)."""

    def describe(self) -> str:
        """How it ended (``killed by SIGKILL``, ``exited with code 1``, ``its Ray actor died:
        ...``), or ``its connection closed`` when that is not known (yet)."""

    def killed(self) -> bool:
        """True once it has ended without exiting by itself: killed by a signal (the OOM
        killer, an operator, a lost machine) or, under Ray, its actor died. Such an end need
        not repeat when the rank starts again; an exit code (an error while starting) would.
        False while it runs."""

    def kill(self) -> None:
        """Stop it at once (no-op once it has ended)."""

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for it to end; True if it has."""


def describe_exit(code: int | None) -> str:
    """A process's exit code in words (None: still running, so only its connection closed)."""
    if code is None:
        return "its connection closed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class LocalRankProcess:
    """A rank process on this machine (``python -m batchgen.distributed.launch --rank R``)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.name = f"pid {popen.pid}"

    def done(self) -> bool:
        return self.popen.poll() is not None

    def describe(self) -> str:
        return describe_exit(self.popen.poll())

    def killed(self) -> bool:
        code = self.popen.poll()
        return code is not None and code < 0

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def wait(self, timeout: float) -> bool:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


def start_local_ranks(
    num_local: int, port: int, authkey: bytes, ranks: list[int] | None = None
) -> dict[int, LocalRankProcess]:
    """Ranks 0 .. ``num_local`` - 1 (or only ``ranks`` of them, started again after a
    failure) as processes of this machine, joining the frontend at 127.0.0.1:``port``.

    A fresh interpreter per rank (not multiprocessing's spawn, which re-imports the user's main
    module); the key travels in the environment, not on the command line (`ps` shows that).
    """
    env = dict(os.environ, **{AUTHKEY_ENV: authkey.decode()})
    return {
        r: LocalRankProcess(
            subprocess.Popen(
                rank_command(r, r, num_local, "127.0.0.1", port),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        )
        for r in (range(num_local) if ranks is None else ranks)
    }
