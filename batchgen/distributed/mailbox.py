"""The frontend's side of one rank's connection, in two background threads, so that sending
never waits for the rank and the rank's messages are always read.

Why: a `multiprocessing.connection.Connection` send blocks once the socket buffer is full.
With a blocking send on both sides, a frontend sending a large batch of requests to rank 0
(busy in a collective, not reading) stops reading rank 1, whose output send then blocks,
so rank 1 never reaches the collective rank 0 waits in: a three-way deadlock that ends only
when gloo's timeout fires (found by an adversarial run: 2,000 prompts with 20 logprobs each).
Here a reader thread drains every rank at all times into one shared inbox, and a writer thread
per rank sends from an unbounded outbox, so the frontend's loop never blocks on a rank.

Messages from one rank keep their order, and so do messages to it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

# Put in the inbox, in place of a message, when a rank's connection closes (EOF or error).
CLOSED = object()
_STOP = object()


class Mailbox:
    """Background send and receive on ``conn``, for the peer named ``key``.

    Args:
        key: what the inbox entries carry to say who sent them (the frontend's `RankHandle`).
        conn: the connection; the mailbox owns it from now on.
        inbox: shared queue receiving ``(key, message)``, then ``(key, CLOSED)`` once.
        on_message: called in the reader thread with each message as it arrives (the
            frontend notes heartbeats there, so a busy frontend loop never mistakes a live
            rank for a silent one).
    """

    def __init__(
        self,
        key: object,
        conn: Connection,
        inbox: queue.Queue,
        on_message: Callable[[object], None] | None = None,
    ) -> None:
        self.key, self.conn, self.inbox = key, conn, inbox
        self._on_message = on_message
        self._outbox: queue.Queue = queue.Queue()
        self.send_error: BaseException | None = None
        self._reader = threading.Thread(
            target=self._read, name="batchgen-mailbox-read", daemon=True
        )
        self._writer = threading.Thread(
            target=self._write, name="batchgen-mailbox-write", daemon=True
        )
        self._reader.start()
        self._writer.start()

    def send(self, message: object) -> None:
        """Queue ``message`` for the rank; returns at once. A send that fails (the rank is
        gone) is dropped: the reader's `CLOSED` reports the rank's end."""
        self._outbox.put(message)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the queued messages to be sent; True if they were."""
        done = threading.Event()
        self._outbox.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Stop the writer (after what is queued) and close the connection."""
        self._outbox.put(_STOP)
        self._writer.join(timeout=1.0)
        try:
            self.conn.close()
        except OSError:
            pass

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: closed under us
                self.inbox.put((self.key, CLOSED))
                return
            if self._on_message is not None:
                self._on_message(message)
            self.inbox.put((self.key, message))

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is _STOP:
                return
            if isinstance(message, threading.Event):
                message.set()
                continue
            if self.send_error is not None:
                continue  # the rank is gone; drop the rest (flush markers still fire)
            try:
                self.conn.send(message)
            except (OSError, ValueError) as exc:
                self.send_error = exc
