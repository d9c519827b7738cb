"""The frontend's ranks: starting them (local processes, Ray actors, or ranks that connect from
other machines or from torchrun), talking to them, and telling when one fails.

A `RankSet` owns a listener (`multiprocessing.connection`, HMAC-authenticated), the ranks it
started (`RankProcess`: processes of this machine, or Ray actors with
``distributed_executor_backend='ray'``), and one connection per rank. `receive` is the only
way messages come in, and it is where failures are found:

- a rank whose connection closes (it died; its exit code or Ray says how) is reported at once;
- a rank that sends `Failed` reports its own error (often a peer's death seen from a
  collective), so the dead and the stuck are named before it;
- a rank silent for ``distributed_timeout_s`` (it heartbeats every `HEARTBEAT_S`, even
  mid-step) is reported stuck, with the step and phase it was last seen in.

Every failure stops the remaining ranks and raises `RankFailedError`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from multiprocessing.connection import Listener

from batchgen.config import EngineConfig, ParallelConfig
from batchgen.distributed import protocol as msg
from batchgen.distributed.mailbox import CLOSED, Mailbox
from batchgen.distributed.rank_handle import (
    RankFailedError,
    RankHandle,
    describe_end,
    silence,
    where,
)
from batchgen.distributed.rank_process import RankProcess, start_local_ranks

logger = logging.getLogger(__name__)

# Ranks must connect within max(distributed_timeout_s, this); the wait is logged every
# CONNECT_LOG_S seconds.
MIN_CONNECT_TIMEOUT_S = 60.0
CONNECT_LOG_S = 10.0
# A rank whose heartbeat is this late when another rank fails is named stuck.
STUCK_AFTER_S = 3 * msg.HEARTBEAT_S


class RankSet:
    """Start ``parallel.data_parallel_size`` ranks and hand them ``config``.

    Raises:
        ValueError: ranks expected from elsewhere without ``$BATCHGEN_DP_AUTHKEY``.
        RankFailedError: a rank failed or did not connect while starting.
    """

    def __init__(self, config: EngineConfig, parallel: ParallelConfig) -> None:
        self.config, self.parallel = config, parallel
        self.ranks: list[RankHandle] = []
        self._inbox: queue.Queue = queue.Queue()  # (RankHandle, message or CLOSED)
        self.failure: RankFailedError | None = None
        self.closed = False
        self._ray = None  # the RayExecutor, under distributed_executor_backend='ray'
        if parallel.distributed_executor_backend == "ray":
            from batchgen.distributed.ray_executor import RayExecutor

            self._ray = RayExecutor(config, parallel)  # joins or starts Ray, places the ranks
        try:
            self._listener, self._authkey = self._listen()
        except BaseException:
            if self._ray is not None:
                self._ray.close()
            raise
        self._finalizer = weakref.finalize(
            self, RankSet._kill, [], self._listener, self._ray and self._ray.close
        )
        try:
            self.ready = self._start()
        except BaseException:
            self.shutdown()
            raise

    @property
    def max_model_len(self) -> int:
        return min(r.max_model_len for r in self.ready)

    def _num_local(self) -> int:
        """Ranks this frontend starts itself (the others connect from elsewhere)."""
        local = self.parallel.data_parallel_size_local
        return self.parallel.data_parallel_size if local is None else local

    def _listen(self) -> tuple[Listener, bytes]:
        p = self.parallel
        external = self._num_local() < p.data_parallel_size
        if self._ray is not None:  # actors anywhere in the cluster dial this machine's address
            authkey, address = os.urandom(16).hex().encode(), self._ray.driver_address
        elif external:
            key = os.environ.get(msg.AUTHKEY_ENV)
            if not key:
                raise ValueError(
                    f"ranks started on other machines need a shared key: set ${msg.AUTHKEY_ENV} "
                    "to the same secret for the frontend and every `batchgen.distributed."
                    "launch` / torchrun process"
                )
            authkey = key.encode()
            address = p.data_parallel_address
        else:
            authkey, address = os.urandom(16).hex().encode(), "127.0.0.1"
        listener = Listener((address, p.data_parallel_rpc_port or 0), authkey=authkey)
        return listener, authkey

    def _start(self) -> list[msg.Ready]:
        p = self.parallel
        world, local = p.data_parallel_size, self._num_local()
        address, port = self._listener.address
        if self._ray is not None:
            processes = self._ray.start(address, port, self._authkey)
        else:
            processes = start_local_ranks(local, port, self._authkey)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self,
            RankSet._kill,
            list(processes.values()),
            self._listener,
            self._ray and self._ray.close,
        )
        if local < world:
            logger.info(
                "waiting for %d rank(s) from other machines at %s:%d", world - local, address, port
            )
        hellos = self._accept(world, processes)
        init_method = self._init_method(hellos)
        for rank in self.ranks:
            rank.last_seen = time.monotonic()
            rank.mailbox = Mailbox(rank, rank.conn, self._inbox, rank.note)
            rank.mailbox.send(msg.Setup(self.config, p, init_method))
        return self._wait_ready()

    def _accept(
        self, world: int, processes: dict[int, RankProcess]
    ) -> dict[int, tuple[msg.Hello, str]]:
        """Accept ``world`` ranks (in a thread: `Listener.accept` has no timeout), watching the
        ranks this frontend started meanwhile."""
        arrived: queue.Queue = queue.Queue()

        def accept_all():
            while True:
                try:
                    conn = self._listener.accept()
                except (OSError, EOFError):
                    return  # listener closed
                except Exception as exc:  # multiprocessing.AuthenticationError: another key
                    logger.warning(
                        "refused a connection with another key (%s): ranks need the frontend's $%s",
                        exc,
                        msg.AUTHKEY_ENV,
                    )
                    continue
                peer = self._listener.last_accepted
                arrived.put((conn, peer[0] if isinstance(peer, tuple) else "127.0.0.1"))

        threading.Thread(target=accept_all, name="batchgen-accept", daemon=True).start()
        hellos: dict[int, tuple[msg.Hello, str]] = {}
        timeout = max(self.parallel.distributed_timeout_s, MIN_CONNECT_TIMEOUT_S)
        start = time.monotonic()
        next_log = start + CONNECT_LOG_S
        while len(hellos) < world:
            for r, proc in processes.items():
                if r not in hellos and proc.done():
                    # killed (by a signal, or its Ray actor lost): a restart may outlive it; an
                    # exit code (an error while starting) would repeat
                    raise RankFailedError(
                        f"rank {r} ({proc.name}) {proc.describe()} before connecting",
                        [r],
                        recoverable=proc.killed(),
                    )
            now = time.monotonic()
            missing = sorted(set(range(world)) - set(hellos))
            if now - start > timeout:
                # silent, like a rank that stops heartbeating: a restart may help when this
                # frontend started them (it cannot restart ranks started elsewhere)
                raise RankFailedError(
                    f"ranks {missing} did not connect within {timeout:.0f} s "
                    f"(distributed_timeout_s) to {self._listener.address[0]}:"
                    f"{self._listener.address[1]}",
                    missing,
                    recoverable=all(r in processes for r in missing),
                )
            if now >= next_log:
                logger.info(
                    "still waiting for ranks %s at %s:%d (%.0f of %.0f s)",
                    missing,
                    *self._listener.address,
                    now - start,
                    timeout,
                )
                next_log = now + CONNECT_LOG_S
            try:
                conn, peer = arrived.get(timeout=0.2)
            except queue.Empty:
                continue
            hello = conn.recv() if conn.poll(5) else None
            if not isinstance(hello, msg.Hello) or not 0 <= hello.rank < world:
                logger.warning("refused a connection from %s that is not a rank of this job", peer)
                conn.close()
                continue
            if hello.rank in hellos:
                logger.warning(
                    "refused a second process claiming rank %d (pid %d on %s)",
                    hello.rank,
                    hello.pid,
                    hello.host,
                )
                conn.close()
                continue
            hellos[hello.rank] = (hello, peer)
            self.ranks.append(
                RankHandle(
                    hello.rank,
                    conn,
                    hello.host,
                    hello.pid,
                    processes.get(hello.rank),
                    node_id=hello.node_id,
                )
            )
        self.ranks.sort(key=lambda r: r.rank)
        return hellos

    @staticmethod
    def _init_method(hellos: dict[int, tuple[msg.Hello, str]]) -> str:
        """``env://`` when torchrun started every rank, else rank 0's machine and port."""
        torchrun = {h.torchrun for h, _ in hellos.values()}
        if torchrun == {True}:
            return "env://"
        if True in torchrun:
            raise ValueError("ranks started by torchrun and by other means cannot be mixed")
        hello, peer = hellos[0]
        return f"tcp://{peer}:{hello.store_port}"

    def _wait_ready(self) -> list[msg.Ready]:
        ready: dict[int, msg.Ready] = {}
        while len(ready) < len(self.ranks):
            for rank, message in self.receive(timeout=1.0):
                if isinstance(message, msg.Ready):
                    ready[rank.rank] = message
        return [ready[r] for r in sorted(ready)]

    # ---- messages ------------------------------------------------------------------------
    def send(self, rank: RankHandle, message) -> None:
        """Queue ``message`` for ``rank``; never blocks (see `Mailbox`)."""
        rank.mailbox.send(message)

    def broadcast(self, message) -> None:
        for rank in self.ranks:
            rank.mailbox.send(message)

    def receive(self, timeout: float) -> list[tuple[RankHandle, object]]:
        """Messages that arrive within ``timeout`` seconds (all that are in once one is).

        Raises:
            RankFailedError: a rank's connection closed or its process exited, a rank sent
                `Failed`, or a rank was silent for ``distributed_timeout_s``.
        """
        if self.failure is not None:
            raise self.failure
        items = []
        try:
            items.append(
                self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            )
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        broken: list[RankHandle] = []
        failed: list[tuple[RankHandle, str]] = []
        got: list[tuple[RankHandle, object]] = []
        for rank, message in items:
            if message is CLOSED:
                broken.append(rank)
            elif isinstance(message, msg.Failed):
                failed.append((rank, message.message))
            elif not isinstance(message, msg.Heartbeat):
                got.append((rank, message))
        if broken or failed:
            self._fail(broken, failed)
        now = time.monotonic()
        silent = [r for r in self.ranks if now - r.last_seen > self.parallel.distributed_timeout_s]
        if silent:
            self._fail_silent(silent, now)
        return got

    def _fail(self, broken: list[RankHandle], failed: list[tuple[RankHandle, str]]) -> None:
        """Report the ranks at fault. A rank that dies or stalls takes its peers' collectives
        down with it, so their `Failed` reports arrive too: wait a moment for the deaths to
        show, then name the dead first, then ranks whose heartbeats stopped (stuck), then the
        ranks that failed on their own."""
        time.sleep(0.5)
        ended = {r.rank for r in self.ranks if r.process is not None and r.process.done()}
        self._read_last_words(broken, failed, ended)
        reported = {r.rank for r, _ in failed}  # these exit by themselves after reporting
        for rank in self.ranks:
            if rank.rank in ended and rank not in broken:
                broken.append(rank)
        dead = sorted(
            {r.rank: r for r in broken if r.rank not in reported}.values(), key=lambda r: r.rank
        )
        parts = [f"rank {r.rank} ({where(r)}) died: {describe_end(r)}" for r in dead]
        now = time.monotonic()
        culprit_ids = {r.rank for r in dead}
        stuck = [
            r for r in self.ranks if r.rank not in culprit_ids and now - r.last_seen > STUCK_AFTER_S
        ]
        parts += [silence(r, now) for r in stuck]
        culprit_ids |= {r.rank for r in stuck}
        for rank, text in failed:
            if rank.rank not in culprit_ids:
                first = text.strip().splitlines()[0] if text.strip() else "unknown error"
                parts.append(f"rank {rank.rank} failed: {first}")
        culprits = sorted(culprit_ids) or [r.rank for r, _ in failed]
        self.failure = RankFailedError("; ".join(parts), culprits, recoverable=bool(culprit_ids))
        self.shutdown()
        raise self.failure

    def _read_last_words(
        self, broken: list[RankHandle], failed: list[tuple[RankHandle, str]], ended: set[int]
    ) -> None:
        """Add what came in meanwhile to ``broken`` and ``failed``, reading until every rank in
        ``ended`` has closed (at most a second): a peer that reported `Failed` and then
        exited is not dead, only failed because of the dead one."""
        deadline = time.monotonic() + 1.0
        while True:
            waiting = ended - {r.rank for r in broken}
            try:
                rank, message = self._inbox.get(
                    timeout=max(0.0, deadline - time.monotonic()) if waiting else 0
                )
            except queue.Empty:
                return
            if message is CLOSED:
                broken.append(rank)
            elif isinstance(message, msg.Failed):
                failed.append((rank, message.message))

    def _fail_silent(self, silent: list[RankHandle], now: float) -> None:
        parts = [silence(r, now) for r in silent]
        self.failure = RankFailedError("; ".join(parts), [r.rank for r in silent], recoverable=True)
        self.shutdown()
        raise self.failure

    # ---- shutdown ------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the ranks (politely, then by force) and close the listener. Idempotent."""
        if self.closed:
            return
        self.closed = True
        with_mail = [r for r in self.ranks if r.mailbox is not None]
        for rank in with_mail:
            rank.mailbox.send(msg.Shutdown())
        for rank in self.ranks:
            if rank.mailbox is None:  # accepted, never set up
                try:
                    rank.conn.send(msg.Shutdown())
                except OSError:
                    pass
        deadline = time.monotonic() + (timeout if self.failure is None else 2.0)
        open_ranks = {id(r) for r in with_mail}
        while open_ranks and time.monotonic() < deadline:  # a rank closes its end as it leaves
            try:
                rank, message = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if message is CLOSED:
                open_ranks.discard(id(rank))
        for rank in self.ranks:
            if rank.process is not None:
                rank.process.wait(max(0.1, deadline - time.monotonic()))
        self._finalizer()  # kills what is left, closes the listener (and Ray's placement group)
        for rank in self.ranks:
            if rank.mailbox is not None:
                rank.mailbox.close()
            else:
                rank.conn.close()

    @staticmethod
    def _kill(processes: list[RankProcess], listener: Listener | None, close_executor) -> None:
        for proc in processes:
            proc.kill()
        for proc in processes:
            proc.wait(10)
        if listener is not None:
            try:
                listener.close()
            except OSError:
                pass
        if close_executor is not None:
            close_executor()
