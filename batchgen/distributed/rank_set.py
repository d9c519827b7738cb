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
  mid-step) is reported stuck, with the step and phase it was last seen in;
- a rank still starting (heartbeating) that holds up the start, as its group's ranks wait for
  it or the ranks set up with it are ready, is reported stuck, or too slow, while starting
  (`RankMessages._loading_laggards`).

Every failure raises `RankFailedError` and stops the remaining ranks, or, for elastic recovery,
only the restart groups of the ranks at fault (`replace` starts them again, and `receive` takes
them in as they connect and load, while the others run on).

This module starts, replaces and stops the ranks; the messaging (`send`, `broadcast`,
`receive`) is the mixin `RankMessages` (`rank_messages.py`), the naming and containing of a
failure the mixin `RankFailures` (`rank_failures.py`).
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
from batchgen.distributed.rank_failures import RankFailures, close
from batchgen.distributed.rank_handle import RankFailedError, RankHandle, where
from batchgen.distributed.rank_join import Joining
from batchgen.distributed.rank_messages import STARTING_SILENCE_S, RankMessages
from batchgen.distributed.rank_process import RankProcess, start_local_ranks

logger = logging.getLogger(__name__)

# Seconds a failed or interrupted start waits for ranks to leave before killing them.
START_SHUTDOWN_GRACE_S = 3.0
# Ranks must connect within max(distributed_timeout_s, this).
MIN_CONNECT_TIMEOUT_S = STARTING_SILENCE_S


class RankSet(RankMessages, RankFailures):
    """Start ``parallel.data_parallel_size`` ranks and hand them ``config``. ``start_took``:
    seconds an earlier start of the same job took (when every rank starts again after a
    failure), the bound of this start when all its ranks hang (`start_took` below).

    Raises:
        ValueError: ranks expected from elsewhere without ``$BATCHGEN_DP_AUTHKEY``.
        RankFailedError: a rank failed or did not connect while starting.
    """

    # Seconds the last start of every rank took (its slowest rank, from `Setup` to `Ready`):
    # how long ranks started again may take, when none started with them is ahead
    # (`RankMessages._loading_laggards`).
    start_took: float | None = None

    def __init__(
        self, config: EngineConfig, parallel: ParallelConfig, start_took: float | None = None
    ) -> None:
        self.config, self.parallel = config, parallel
        self.start_took = start_took
        self.ranks: list[RankHandle] = []
        self._inbox: queue.Queue = queue.Queue()  # (RankHandle, message or CLOSED)
        self._held: list[tuple[RankHandle, object]] = []  # for the next `receive`
        self.failure: RankFailedError | None = None
        self.closed = False
        self._ray = None  # the RayExecutor, under distributed_executor_backend='ray'
        self._joining = Joining(resolve_layout(parallel))  # ranks started again (`replace`)
        # Applied by every rank at setup: the updates made since the start (`frontend_weights`).
        self.weight_updates: list[msg.UpdateWeights] = []
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
            # No request taken yet: ranks still loading (they read Shutdown only once loaded)
            # get a short grace, then are killed.
            self.shutdown(timeout=START_SHUTDOWN_GRACE_S)
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
        """Whether a failed group's ranks are stopped alone while the others run on (then
        started again, `replace`, or retired for good, `retire_for_good`): elastic recovery
        is on."""
        return self.parallel.enable_elastic_recovery

    def restartable(self, ranks: list[int]) -> bool:
        """Whether this frontend started ``ranks`` (local processes: ranks 0 ..
        ``data_parallel_size_local`` - 1; Ray actors: every rank) and so can start them again;
        not ranks of ``torchrun`` or of another machine's launcher."""
        return all(r < self._num_local() for r in ranks)

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
        ready = self._wait_ready(self.ranks)
        self.start_took = max(r.ready_at - r.set_up_at for r in self.ranks)
        return ready

    def _connect_timeout(self) -> float:
        return max(self.parallel.distributed_timeout_s, MIN_CONNECT_TIMEOUT_S)

    def _accept(
        self, expected: set[int], processes: dict[int, RankProcess]
    ) -> dict[int, tuple[RankHandle, msg.Hello, str]]:
        return accept_ranks(
            self._arrived, expected, processes, self._connect_timeout(), self._listener.address
        )

    def _set_up(self, joined: dict[int, tuple[RankHandle, msg.Hello, str]]) -> None:
        """Start the mailboxes of the ranks that just joined and send them `Setup`."""
        worlds = self._worlds(joined)
        now = time.monotonic()  # one time for all: ranks set up together are compared
        for r, (rank, _, _) in sorted(joined.items()):
            rank.last_seen = rank.set_up_at = now
            rank.mailbox = Mailbox(rank, rank.conn, self._inbox, rank.note)
            init_method, world_ranks = worlds[r]
            rank.mailbox.send(
                msg.Setup(
                    self.config, self.parallel, init_method, world_ranks, self.weight_updates
                )
            )

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
        `receive` raised) and clear that failure; returns at once. Until a new rank is ready
        its `RankHandle` is ``joining`` (what is queued for it waits in its ``pending``);
        `receive` takes the new ranks in as they connect (`_take_joining`) and load.

        Raises:
            RuntimeError: the set was shut down, or it cannot start ``lost`` again
                (`_can_replace`, `restartable`).
        """
        if self.closed or not (self._can_replace() and self.restartable(lost)):
            raise RuntimeError("these ranks cannot be started again")
        self.failure = None
        processes = self._launch(lost)
        for r in lost:
            process = processes.get(r)
            pid = 0 if process is None else process.pid  # its own, once it says Hello
            self.ranks[r] = RankHandle(r, None, "", pid, process, joining=True)
        self._joining.add(lost, processes)
        logger.info("starting ranks %s again; the others run on", lost)

    @property
    def joining(self) -> bool:
        """Ranks started again are not all ready yet."""
        return any(r.joining for r in self.ranks)

    def _take_joining(self) -> None:
        """Set up the replacement ranks whose restart group has connected (`Joining.poll`);
        the requests queued for them meanwhile stay in their ``pending``.

        Raises:
            RankFailedError: a replacement rank died before connecting or did not connect in
                time (its restart group is stopped again, see `_fail_with`).
        """
        try:
            groups = self._joining.poll(
                self._arrived, self._connect_timeout(), self._listener.address
            )
        except RankFailedError as failure:
            self._fail_with(failure, set(failure.ranks))
        for joined in groups:
            for r, (handle, _, _) in joined.items():
                waiting = self.ranks[r]
                handle.pending, handle.load, handle.joining = waiting.pending, waiting.load, True
                self.ranks[r] = handle
            self._set_up(joined)

    def _joined_again(self, rank: RankHandle, ready: msg.Ready) -> None:
        rank.joining = False
        self.ready[rank.rank] = ready
        logger.info("rank %d joined again (%s); the others ran on", rank.rank, where(rank))

    # ---- shutdown ------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the ranks (politely, then by force) and close the listener. Idempotent."""
        if self.closed:
            return
        self.closed = True
        with_mail = [r for r in self.ranks if r.mailbox is not None and not r.retired]
        for rank in with_mail:
            rank.mailbox.send(msg.Shutdown())
        self._joining.drop(list(self._joining.since))
        for rank in self.ranks:  # started again and not ready: nothing of theirs to wait for
            if rank.joining and rank.process is not None:
                rank.process.kill()
        for rank in self.ranks:
            if rank.mailbox is None and rank.conn is not None:  # accepted, never set up
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
            close(rank)

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

