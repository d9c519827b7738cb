"""A rank's link to its frontend: how it finds the frontend (`RankLaunch`), connecting with
retries (`connect`), and the connection shared by the rank loop and its heartbeat thread
(`Link`). The rank loop itself is `batchgen.distributed.worker`."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection

from batchgen.distributed import protocol as msg
from batchgen.distributed.launch import AUTHKEY_ENV

logger = logging.getLogger("batchgen.distributed.worker")  # the rank's log lines, as before

CONNECT_TIMEOUT_S = 300.0
CONNECT_LOG_S = 10.0
# A rank whose frontend is gone and that has not left this long after finding it gone (its
# heartbeat could not be sent) ends its process (`Link`).
FRONTEND_GONE_GRACE_S = 10.0


@dataclass
class RankLaunch:
    """How a rank process finds its frontend.

    Attributes:
        rank: global rank; local_rank / local_world_size: on this machine.
        address / port: the frontend's listener. authkey: its key.
        torchrun: ranks were started by torchrun (rendezvous from its environment).
        parent_pid: the process that started this rank (a frontend or a launcher); while the
            rank waits for its frontend, it gives up if that process is gone.
        cuda_device: the CUDA device index it uses (default: ``local_rank``); a Ray actor sees
            only its own GPU, device 0.
        node_id: its Ray node (hex), reported to the frontend, under Ray.
    """

    rank: int
    local_rank: int
    local_world_size: int
    address: str
    port: int
    authkey: bytes
    torchrun: bool = False
    parent_pid: int | None = None
    cuda_device: int | None = None
    node_id: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def connect(launch: RankLaunch) -> Connection:
    """Connect to the frontend, retrying while it is not listening yet (saying so every
    `CONNECT_LOG_S` seconds).

    Raises:
        RankStartError: no frontend within `CONNECT_TIMEOUT_S`, it refused this rank's key, or
            the process that started the rank exited meanwhile.
    """
    from multiprocessing import AuthenticationError

    address, port, authkey, rank = launch.address, launch.port, launch.authkey, launch.rank
    start = next_log = time.monotonic()
    while True:
        try:
            return Client((address, port), authkey=authkey)
        except AuthenticationError:
            raise RankStartError(
                f"the frontend at {address}:{port} refused rank {rank}'s key: set "
                f"${AUTHKEY_ENV} to the frontend's secret"
            ) from None
        except (ConnectionRefusedError, FileNotFoundError, OSError):
            if launch.parent_pid is not None and os.getppid() != launch.parent_pid:
                raise RankStartError(
                    f"rank {rank}: the process that started it (pid {launch.parent_pid}) exited "
                    "before its frontend listened"
                ) from None
            now = time.monotonic()
            if now - start > CONNECT_TIMEOUT_S:
                raise RankStartError(
                    f"no frontend listening at {address}:{port} after {CONNECT_TIMEOUT_S:.0f} s"
                ) from None
            if now >= next_log:
                logger.info(
                    "rank %d: waiting for the frontend at %s:%d (%.0f s)",
                    rank,
                    address,
                    port,
                    now - start,
                )
                next_log = now + CONNECT_LOG_S
            time.sleep(0.2)


class RankStartError(RuntimeError):
    """A rank could not join its frontend (message for the user)."""


class Link:
    """The rank's connection: sends from the loop and the heartbeat thread, under a lock.

    The rank's loop finds its frontend gone at its next read and leaves; a rank blocked
    meanwhile never would: one waiting in a start-up collective for a peer that hangs (for
    the rendezvous's 30 minutes), or hanging itself. The frontend kills the ranks it started,
    not those of another machine or of torchrun, so the heartbeat thread, once a heartbeat
    cannot be sent, ends the process if the rank has not stopped (`stop`) within
    `FRONTEND_GONE_GRACE_S`.
    """

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn, self.rank = conn, rank
        self._lock = threading.Lock()
        self.step_id, self.phase = 0, "starting"
        self.counters = None  # a callable returning the rank's live figures, once it has them
        self._stop = threading.Event()

    def send(self, message) -> None:
        with self._lock:
            self.conn.send(message)

    def set_phase(self, phase: str) -> None:
        """What the rank does now: a heartbeat says it at once (`Heartbeat.phase`), so that
        the frontend knows this rank reached a wait for its group before any peer can pass
        it (`RankMessages._loading_laggards`).

        Raises:
            OSError: the connection to the frontend is gone.
        """
        with self._lock:
            self.phase = phase
            self._send_heartbeat()

    def _send_heartbeat(self) -> None:
        """Send a heartbeat of the current phase; called holding the lock, so that no
        heartbeat of an older phase follows one of a newer (the frontend counts the rank's
        waits for its group by the changes of phase: `RankHandle.waits`)."""
        counters = self.counters() if self.counters is not None else {}
        self.conn.send(msg.Heartbeat(self.rank, self.step_id, self.phase, counters))

    def start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(msg.HEARTBEAT_S):
                try:
                    with self._lock:
                        self._send_heartbeat()
                except OSError:
                    self._leave_unless_stopped()
                    return

        threading.Thread(target=beat, name="batchgen-heartbeat", daemon=True).start()

    def _leave_unless_stopped(self) -> None:
        """The frontend is gone: give the rank `FRONTEND_GONE_GRACE_S` to stop by itself,
        then end the process (exit code 1; see the class docstring)."""
        if self._stop.wait(FRONTEND_GONE_GRACE_S):
            return
        logger.error(
            "rank %d: the frontend is gone and this rank is still %s %.0f s later (blocked); "
            "exiting",
            self.rank,
            self.phase,
            FRONTEND_GONE_GRACE_S,
        )
        os._exit(1)

    def stop(self) -> None:
        self._stop.set()
