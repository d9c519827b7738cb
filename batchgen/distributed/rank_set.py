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

Every failure raises `RankFailedError` and stops the remaining ranks, or, for elastic recovery,
only the restart groups of the ranks at fault (`replace` starts them again).
"""

from __future__ import annotations

import logging
import os
import queue
import time
import weakref
from multiprocessing.connection import Listener

from batchgen.config import EngineConfig, ParallelConfig
from batchgen.distributed import protocol as msg
from batchgen.distributed.layout import resolve_layout
from batchgen.distributed.mailbox import CLOSED, Mailbox
from batchgen.distributed.rank_accept import accept_ranks, start_accepting
from batchgen.distributed.rank_handle import (
    RankFailedError,
    RankHandle,
    name_failure,
    silence,
)
from batchgen.distributed.rank_process import RankProcess, start_local_ranks

logger = logging.getLogger(__name__)

# Ranks must connect within max(distributed_timeout_s, this).
MIN_CONNECT_TIMEOUT_S = 60.0
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
        self._held: list[tuple[RankHandle, object]] = []  # for the next `receive`
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

    def _can_replace(self) -> bool:
        """Whether a failed group's ranks are stopped alone and may be started again
        (`replace`) while the others run on: elastic recovery is on and this frontend started
        every rank (it cannot start ranks of torchrun or of other machines' launchers)."""
        p = self.parallel
        return p.enable_elastic_recovery and self._num_local() == p.data_parallel_size

    def _launch(self, ranks: list[int] | None) -> dict[int, RankProcess]:
        """Start ``ranks`` (None: every local rank) as processes or Ray actors."""
        _, port = self._listener.address
        if self._ray is not None:
            processes = self._ray.start(self._listener.address[0], port, self._authkey, ranks)
        else:
            processes = start_local_ranks(self._num_local(), port, self._authkey, ranks)
        self._processes += processes.values()  # the finalizer's list: killed at the end
        return processes

    def _start(self) -> list[msg.Ready]:
        p = self.parallel
        world, local = p.data_parallel_size, self._num_local()
        address, port = self._listener.address
        self._processes: list[RankProcess] = []
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, RankSet._kill, self._processes, self._listener, self._ray and self._ray.close
        )
        processes = self._launch(None)
        if local < world:
            logger.info(
                "waiting for %d rank(s) from other machines at %s:%d", world - local, address, port
            )
        self._arrived = start_accepting(self._listener)
        joined = self._accept(set(range(world)), processes)
        self.ranks.extend(handle for handle, _, _ in joined.values())
        self.ranks.sort(key=lambda r: r.rank)
        self._set_up(joined)
        return self._wait_ready(self.ranks)

    def _accept(
        self, expected: set[int], processes: dict[int, RankProcess]
    ) -> dict[int, tuple[RankHandle, msg.Hello, str]]:
        timeout = max(self.parallel.distributed_timeout_s, MIN_CONNECT_TIMEOUT_S)
        return accept_ranks(self._arrived, expected, processes, timeout, self._listener.address)

    def _set_up(self, joined: dict[int, tuple[RankHandle, msg.Hello, str]]) -> None:
        """Start the mailboxes of the ranks that just joined and send them `Setup`."""
        worlds = self._worlds(joined)
        for r, (rank, _, _) in sorted(joined.items()):
            rank.last_seen = time.monotonic()
            rank.mailbox = Mailbox(rank, rank.conn, self._inbox, rank.note)
            init_method, world_ranks = worlds[r]
            rank.mailbox.send(msg.Setup(self.config, self.parallel, init_method, world_ranks))

    def _worlds(
        self, joined: dict[int, tuple[RankHandle, msg.Hello, str]]
    ) -> dict[int, tuple[str, list[int] | None]]:
        """Each joined rank's ``torch.distributed`` world: ``env://`` and one world of every
        rank when torchrun started them all; else its restart group
        (`ParallelLayout.restart_group`: its expert-parallel group, or itself alone), meeting
        at the group's first rank's machine and free port (every rank of a group joins
        together: the first start, or `replace`)."""
        torchrun = {hello.torchrun for _, hello, _ in joined.values()}
        if torchrun == {True}:
            return {r: ("env://", None) for r in joined}
        if True in torchrun:
            raise ValueError("ranks started by torchrun and by other means cannot be mixed")
        layout = resolve_layout(self.parallel)
        out = {}
        for r in joined:
            group = layout.restart_group(r)
            _, hello, peer = joined[group[0]]
            out[r] = (f"tcp://{peer}:{hello.store_port}", group)
        return out

    def _wait_ready(self, ranks: list[RankHandle]) -> list[msg.Ready]:
        """Wait for `Ready` from ``ranks``; what other ranks send meanwhile is kept for the
        next `receive`."""
        ready: dict[int, msg.Ready] = {}
        waiting = {id(r) for r in ranks}
        while len(ready) < len(ranks):
            for rank, message in self._collect(timeout=1.0):
                if isinstance(message, msg.Ready) and id(rank) in waiting:
                    ready[rank.rank] = message
                else:
                    self._held.append((rank, message))
        return [ready[r] for r in sorted(ready)]

    def replace(self, lost: list[int]) -> None:
        """Start ranks ``lost`` again (whole restart groups, stopped by the failure that
        `receive` raised) while the other ranks run on, and clear that failure.

        Raises:
            RankFailedError: a new rank, or a running one, failed meanwhile.
            RuntimeError: the set was shut down, or it cannot replace ranks (`_can_replace`).
        """
        if self.closed or not self._can_replace():
            raise RuntimeError("these ranks cannot be started again")
        self.failure = None
        processes = self._launch(lost)
        joined = self._accept(set(lost), processes)
        for r, (handle, _, _) in joined.items():
            self.ranks[r] = handle
        self._set_up(joined)
        for ready in self._wait_ready([self.ranks[r] for r in lost]):
            self.ready[ready.rank] = ready
        logger.info("ranks %s joined again; the others ran on", lost)

    # ---- messages ------------------------------------------------------------------------
    def send(self, rank: RankHandle, message) -> None:
        """Queue ``message`` for ``rank``; never blocks (see `Mailbox`)."""
        rank.mailbox.send(message)

    def broadcast(self, message) -> None:
        for rank in self.ranks:
            rank.mailbox.send(message)

    def receive(self, timeout: float) -> list[tuple[RankHandle, object]]:
        """Messages that arrive within ``timeout`` seconds (all that are in once one is),
        after those kept while ranks started again or while a failure was found.

        Raises:
            RankFailedError: a rank's connection closed or its process exited, a rank sent
                `Failed`, or a rank was silent for ``distributed_timeout_s``. The messages
                that came with the failure are kept for the next call (`take_held`).
        """
        if self.failure is not None:
            raise self.failure
        got = self._collect(0 if self._held else timeout)
        held, self._held = self._held, []
        return held + got

    def take_held(self) -> list[tuple[RankHandle, object]]:
        """The messages kept back (see `receive`), e.g. outputs that arrived with a failure."""
        held, self._held = self._held, []
        return held

    def _collect(self, timeout: float) -> list[tuple[RankHandle, object]]:
        """Read the inbox (see `receive`): messages of ranks replaced since are dropped."""
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
            self._sort(rank, message, broken, failed, got)
        if broken or failed:
            self._fail(broken, failed, got)
        now = time.monotonic()
        silent = [r for r in self.ranks if now - r.last_seen > self.parallel.distributed_timeout_s]
        if silent:
            self._held += got
            ids = [r.rank for r in silent]
            text = "; ".join(silence(r, now) for r in silent)
            self._fail_with(RankFailedError(text, ids, recoverable=True), set(ids))
        return got

    def _sort(self, rank: RankHandle, message, broken: list, failed: list, got: list) -> None:
        if rank.retired:
            return  # a rank replaced after a failure: its last words were read then
        if message is CLOSED:
            broken.append(rank)
        elif isinstance(message, msg.Failed):
            failed.append((rank, message.message))
        elif not isinstance(message, msg.Heartbeat):
            got.append((rank, message))

    def _fail(
        self,
        broken: list[RankHandle],
        failed: list[tuple[RankHandle, str]],
        got: list[tuple[RankHandle, object]],
    ) -> None:
        """Report the ranks at fault. A rank that dies or stalls takes its peers' collectives
        down with it, so their `Failed` reports arrive too: wait a moment for the deaths to
        show, then name the dead first, then ranks whose heartbeats stopped (stuck), then the
        ranks that failed on their own. The other messages read meanwhile (``got`` and what
        follows) are kept for the next `receive`: a rank that runs on has forgotten its
        finished outputs once sent."""
        time.sleep(0.5)
        ended = {r.rank for r in self.ranks if r.process is not None and r.process.done()}
        self._read_last_words(broken, failed, got, ended)
        self._held += got
        for rank in self.ranks:
            if rank.rank in ended and rank not in broken:
                broken.append(rank)
        failure, involved = name_failure(self.ranks, broken, failed, STUCK_AFTER_S)
        self._fail_with(failure, involved)

    def _fail_with(self, failure: RankFailedError, involved: set[int]) -> None:
        """Record ``failure`` and stop what it broke, then raise it. With `_can_replace` and
        a recoverable failure, only the restart groups of the ``involved`` ranks (dead, stuck
        or reporting an error) are stopped (``failure.lost``: every rank of those groups), for
        `replace`; else every rank."""
        self.failure = failure
        if failure.recoverable and self._can_replace():
            layout = resolve_layout(self.parallel)
            failure.lost = sorted({m for r in involved for m in layout.restart_group(r)})
            self._retire([self.ranks[r] for r in failure.lost])
        else:
            failure.lost = [r.rank for r in self.ranks]
            self.shutdown()
        raise failure

    def _retire(self, ranks: list[RankHandle]) -> None:
        """Stop ``ranks`` at once (their group is broken) and stop listening to them."""
        for rank in ranks:
            rank.retired = True
            if rank.process is not None:
                rank.process.kill()
        for rank in ranks:
            if rank.process is not None:
                rank.process.wait(10)
            if rank.mailbox is not None:
                rank.mailbox.close()
            else:
                rank.conn.close()

    def _read_last_words(
        self,
        broken: list[RankHandle],
        failed: list[tuple[RankHandle, str]],
        got: list[tuple[RankHandle, object]],
        ended: set[int],
    ) -> None:
        """Add what came in meanwhile to ``broken``, ``failed`` and ``got``, reading until
        every rank in ``ended`` has closed (at most a second): a peer that reported `Failed`
        and then exited is not dead, only failed because of the dead one."""
        deadline = time.monotonic() + 1.0
        while True:
            waiting = ended - {r.rank for r in broken}
            try:
                rank, message = self._inbox.get(
                    timeout=max(0.0, deadline - time.monotonic()) if waiting else 0
                )
            except queue.Empty:
                return
            self._sort(rank, message, broken, failed, got)

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
