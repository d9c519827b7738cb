"""Elastic recovery in the data-parallel frontend (`DPEngineClient`): restarting the ranks a
failure stopped, or retiring them for good, and handing their unfinished requests out again
(the behaviour: the frontend's module docstring; the policy and the figures:
`ElasticRecovery`).

While ranks started again are joining, a background thread (`_watch`) does every
`JOIN_POLL_S` what a metrics poll does (`_poll`: takes in a replacement that connected, sends
it its setup, reads its `Ready`) and outlives a failure found meanwhile (`_recover`), so that
an engine nobody steps or polls still finishes its recovery. It holds the client's lock
(`client_lock`), which every public method of the client holds too (`locked`): the frontend's
state (``requests``, the rank handles, their queues and loads) is only ever touched by one
thread at a time. It exits once no rank is joining (or the engine failed or shut down), and
keeps only a weak reference to the client between polls.

`FrontendRecovery` is a mixin of `batchgen.distributed.frontend.DPEngineClient`; it uses the
client's ``config``, ``parallel``, ``rank_set``, ``_ranks``, ``requests``, ``recovery``,
``rebalancer``, ``_fatal``, ``_finished``, ``_assign``, ``_dispatch`` and ``_poll``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref

from batchgen.config import ParallelConfig
from batchgen.distributed.layout import resolve_layout
from batchgen.distributed.rank_set import RankFailedError, RankSet
from batchgen.outputs import RequestOutput

logger = logging.getLogger(__name__)

# How often the background thread polls while ranks started again are joining (seconds).
JOIN_POLL_S = 0.5


def client_lock(client) -> threading.RLock:
    """The client's lock (re-entrant), made on first use (test doubles skip ``__init__``)."""
    lock = client.__dict__.get("_lock")
    return lock if lock is not None else client.__dict__.setdefault("_lock", threading.RLock())


def locked(method):
    """Run a public method of the client holding its lock (see the module docstring)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with client_lock(self):
            return method(self, *args, **kwargs)

    return run


class FrontendRecovery:
    """`DPEngineClient`'s recovery (see the module docstring)."""

    def _watch_joining(self) -> None:
        """Start the background thread (`_watch`) unless it runs. Called holding the lock."""
        if self.__dict__.get("_watcher") is not None:
            return  # it runs (it clears this itself, holding the lock, as it exits)
        self._watcher = threading.Thread(
            target=_watch, args=(weakref.ref(self),), name="batchgen-recovery", daemon=True
        )
        self._watcher.start()

    def _start_ranks(self) -> RankSet:
        """A new `RankSet`. A recoverable failure while it starts (a rank killed before
        connecting or while loading the model, or never connecting) is one more failure:
        `ElasticRecovery.begin` counts a restart for it and the ranks start again, or it raises.
        A set that failed to start has stopped its processes itself (`RankSet.__init__`).
        After the first, a start is bounded by the last one's time (`RankSet.start_took`)."""
        earlier = self.__dict__.get("rank_set")  # none at the first start
        took = earlier.start_took if earlier is not None else None
        while True:
            try:
                return RankSet(self.config, self.parallel, took)
            except RankFailedError as failure:
                self.recovery.begin(failure, [], 0, len(self.requests))

    def _recover(self, failure: RankFailedError) -> None:
        """Outlive ``failure`` (the frontend's module docstring), or raise it (see
        `ElasticRecovery.plan` and `ElasticRecovery.begin`).

        The ranks it stopped (``failure.lost``: the restart groups of the ranks involved, or
        every rank) start again, or are retired for good when they cannot (`ElasticRecovery.
        plan`: started elsewhere, or the restart budget spent) and another group is left; the
        other ranks run on, with their requests. The stopped ranks' unfinished requests are
        queued again on the ranks left, except those pinned to a retired rank, which fail (an
        output with ``error`` set, returned by the next `step`). The outputs that arrived with
        the failure are taken first, so nothing finished is run twice. When every rank is
        stopped and none retired, every rank is started afresh (`_start_ranks`, within the same
        budget).

        Raises:
            RankFailedError: ``failure``, or the new ranks' last failure to start (not
                recoverable, or past the budget with no other group left). Every later call
                raises it again, and every rank is stopped.
        """
        try:
            self._dispatch(self.rank_set.take_held())
            lost = failure.lost or [r.rank for r in self._ranks]
            retired = set(self.rank_set.retired_ranks) - set(lost)  # for good, earlier
            groups = _groups(self.parallel, lost)
            others_left = any(r.rank not in lost and r.rank not in retired for r in self._ranks)
            restart, retire = self.recovery.plan(
                failure, groups, self.rank_set.restartable, others_left
            )
            if retire:
                self._retire_for_good(failure, retire)
            alone = others_left or retire or retired  # not every rank starts again
            if restart:
                self.recovery.begin(
                    failure,
                    [self._ranks[r] for r in restart],
                    sum(self._ranks[r].done_tokens for r in restart),
                    sum(1 for e in self.requests.values() if e.rank in lost),
                    restart if alone else None,
                )
            if restart and alone and not self.rank_set.closed:
                self.rank_set.replace(restart)  # returns at once: they join as they load
                self._watch_joining()
            elif restart:
                self.rank_set.shutdown()
                self.rank_set = self._start_ranks()
        except RankFailedError as fatal:
            self._fatal = fatal
            self.rank_set.shutdown()
            raise
        self._ranks = self.rank_set.ranks
        self.rebalancer.forget(lost)  # moves from the stopped ranks died with them
        requeue = [(i, e) for i, e in self.requests.items() if e.rank in lost]
        for request_id, request in requeue:
            del self.requests[request_id]
            request.reset()
            self._assign(request_id, request)
        self.recovery.requeue([i for i, _ in requeue], restart)
        self._check_recovered()

    def _retire_for_good(self, failure: RankFailedError, retire: list[int]) -> None:
        """Take ranks ``retire`` out of the job (`RankSet.retire_for_good`); fail the
        unfinished requests pinned to them, one output each with the reason."""
        restartable = self.rank_set.restartable(retire)
        why = (
            "the restart budget is spent"
            if restartable
            else "started by torchrun or on another machine, they cannot be started again"
        )
        self.recovery.retire(
            [self._ranks[r] for r in retire], sum(self._ranks[r].done_tokens for r in retire), why
        )
        self.rank_set.retire_for_good(retire)
        for request_id, entry in list(self.requests.items()):
            if entry.pinned in retire:
                del self.requests[request_id]
                self._finished.append(
                    RequestOutput(
                        request_id,
                        entry.processed.prompt,
                        entry.processed.prompt_token_ids,
                        [],
                        finished=True,
                        error=retired_rank_error(entry.pinned, why, failure),
                    )
                )
    def _check_recovered(self) -> None:
        """End the recovery under way once no rank started again is still joining, at the
        time the last one's `Ready` arrived (not when this frontend read it)."""
        if self.recovery.recovering and not self.rank_set.joining:
            restarted = [self._ranks[r] for r in self.recovery.restarted]
            times = [r.ready_at for r in restarted if r.ready_at is not None]
            self.recovery.end(len(restarted), max(times) if times else None)


def retired_rank_error(rank: int, why: str, failure: RankFailedError | None = None) -> str:
    """The error of a request pinned (``data_parallel_rank``) to ``rank``, retired for good."""
    cause = "" if failure is None else f" after: {failure}"
    return (
        f"data_parallel_rank {rank} was retired for good by elastic recovery ({why}){cause}; "
        "submit the request without data_parallel_rank, or pinned to another rank"
    )


def _groups(parallel: ParallelConfig, ranks: list[int]) -> list[list[int]]:
    """The restart groups (`ParallelLayout.restart_group`) that make up ``ranks``, in order."""
    layout = resolve_layout(parallel)
    groups: list[list[int]] = []
    for r in ranks:
        group = layout.restart_group(r)
        if group not in groups:
            groups.append(group)
    return groups


def _watch(ref: weakref.ref) -> None:
    """The background thread of the module docstring: ``ref`` is the client's weak reference."""
    while True:
        time.sleep(JOIN_POLL_S)
        client = ref()
        if client is None:
            return
        with client_lock(client):
            try:
                going = _watch_once(client)
            except BaseException as exc:  # noqa: BLE001  (a thread's exception is lost)
                going = False
                _give_up(client, exc)
            if not going:
                client._watcher = None  # under the lock: `_watch_joining` starts a new one
                return
        del client


def _give_up(client, exc: BaseException) -> None:
    """The background thread raised ``exc`` (not a rank failure: a bug, or a bad message),
    perhaps halfway through a recovery: stop every rank and make the client's next call raise
    a `RankFailedError` that carries it (``__cause__``), as a failure recovery did not outlive
    (`batchgen run` then keeps every finished result and suggests ``--resume``), rather than
    lose it with the thread and leave the engine half-recovered."""
    logger.error("elastic recovery's background thread failed", exc_info=exc)
    fatal = RankFailedError(
        f"elastic recovery's background thread failed: {type(exc).__name__}: {exc}; every "
        "rank is stopped",
        [],
    )
    fatal.__cause__ = exc
    client._fatal = fatal
    try:
        client.rank_set.shutdown(timeout=5.0)
    except Exception:  # noqa: BLE001  (the failure above is the one to report)
        logger.exception("stopping the ranks after the background thread failed")


def _watch_once(client) -> bool:
    """One poll of `_watch`; False when there is nothing left to watch."""
    rank_set = client.rank_set
    if client._fatal is not None or rank_set.closed:
        return False
    if rank_set.failure is not None:
        try:
            client._recover(rank_set.failure)
        except RankFailedError:
            return False  # recorded in ``_fatal``: the next call raises it
        return True
    if not rank_set.joining:
        return False
    client._poll()
    client._check_recovered()  # the recovery ends with the Ready just read
    return True
