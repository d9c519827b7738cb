"""Taking the ranks' connections at the frontend's listener: one accept thread per `RankSet`
for its whole life (the first start and every replacement of ranks after a failure), and
`accept_ranks`, which waits for the expected ranks' `Hello`s while watching the processes the
frontend started for them."""

from __future__ import annotations

import logging
import queue
import threading
import time
from multiprocessing.connection import Listener

from batchgen.distributed import protocol as msg
from batchgen.distributed.rank_handle import RankFailedError, RankHandle
from batchgen.distributed.rank_process import RankProcess

logger = logging.getLogger(__name__)

# The wait for ranks to connect is logged every CONNECT_LOG_S seconds.
CONNECT_LOG_S = 10.0


def start_accepting(listener: Listener) -> queue.Queue:
    """Accept connections on ``listener`` in a daemon thread until it closes
    (`Listener.accept` has no timeout); returns the queue of ``(conn, peer host)`` it fills.
    A connection with another key is refused and logged."""
    arrived: queue.Queue = queue.Queue()

    def accept_all():
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError):
                return  # listener closed
            except Exception as exc:  # multiprocessing.AuthenticationError: another key
                logger.warning(
                    "refused a connection with another key (%s): ranks need the frontend's $%s",
                    exc,
                    msg.AUTHKEY_ENV,
                )
                continue
            peer = listener.last_accepted
            arrived.put((conn, peer[0] if isinstance(peer, tuple) else "127.0.0.1"))

    threading.Thread(target=accept_all, name="batchgen-accept", daemon=True).start()
    return arrived


def accept_ranks(
    arrived: queue.Queue,
    expected: set[int],
    processes: dict[int, RankProcess],
    timeout: float,
    address: tuple[str, int],
) -> dict[int, tuple[RankHandle, msg.Hello, str]]:
    """Wait for the ranks in ``expected`` to connect and say `Hello`.

    Args:
        arrived: the accept thread's queue (`start_accepting`).
        processes: the ranks this frontend started for this wait (watched: one that ends
            before connecting is reported at once).
        timeout: seconds before the missing ranks are reported.
        address: the listener's, for messages.
    Returns:
        rank -> (its new `RankHandle`, its `Hello`, the host it connected from).
    Raises:
        RankFailedError: see `check_started`.
    """
    got: dict[int, tuple[RankHandle, msg.Hello, str]] = {}
    start = time.monotonic()
    next_log = start + CONNECT_LOG_S
    while len(got) < len(expected):
        waiting = {r: start for r in expected if r not in got}
        check_started(waiting, processes, timeout, address)
        now = time.monotonic()
        if now >= next_log:
            logger.info(
                "still waiting for ranks %s at %s:%d (%.0f of %.0f s)",
                sorted(waiting),
                *address,
                now - start,
                timeout,
            )
            next_log = now + CONNECT_LOG_S
        try:
            conn, peer = arrived.get(timeout=0.2)
        except queue.Empty:
            continue
        take_hello(conn, peer, expected, got, processes)
    return got


def check_started(
    waiting: dict[int, float],
    processes: dict[int, RankProcess],
    timeout: float,
    address: tuple[str, int],
) -> None:
    """Raise if a rank in ``waiting`` (rank -> when its wait began, `time.monotonic`) cannot
    connect any more.

    Raises:
        RankFailedError: a started rank ended before connecting (recoverable if it was killed,
            not if it exited with a code), or ranks did not connect within ``timeout`` seconds
            (recoverable if this frontend started them all).
    """
    for r in sorted(waiting):
        proc = processes.get(r)
        if proc is not None and proc.done():
            # killed (by a signal, or its Ray actor lost): a restart may outlive it; an
            # exit code (an error while starting) would repeat
            raise RankFailedError(
                f"rank {r} ({proc.name}) {proc.describe()} before connecting",
                [r],
                recoverable=proc.killed(),
            )
    now = time.monotonic()
    late = sorted(r for r, since in waiting.items() if now - since > timeout)
    if late:
        # silent, like a rank that stops heartbeating: a restart may help when this
        # frontend started them (it cannot restart ranks started elsewhere)
        raise RankFailedError(
            f"ranks {late} did not connect within {timeout:.0f} s "
            f"(distributed_timeout_s) to {address[0]}:{address[1]}",
            late,
            recoverable=all(r in processes for r in late),
        )


def take_hello(
    conn,
    peer: str,
    expected: set[int],
    got: dict[int, tuple[RankHandle, msg.Hello, str]],
    processes: dict[int, RankProcess],
) -> None:
    """Read a new connection's `Hello` and add it to ``got`` (rank -> its new `RankHandle`,
    the `Hello`, the host it connected from), or refuse it: not a rank in ``expected``, or a
    second process claiming a rank."""
    hello = conn.recv() if conn.poll(5) else None
    if not isinstance(hello, msg.Hello) or hello.rank not in expected:
        logger.warning("refused a connection from %s that is not a rank expected now", peer)
        conn.close()
        return
    if hello.rank in got:
        logger.warning(
            "refused a second process claiming rank %d (pid %d on %s)",
            hello.rank,
            hello.pid,
            hello.host,
        )
        conn.close()
        return
    handle = RankHandle(
        hello.rank,
        conn,
        hello.host,
        hello.pid,
        processes.get(hello.rank),
        node_id=hello.node_id,
    )
    got[hello.rank] = (handle, hello, peer)
