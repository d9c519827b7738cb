"""Elastic recovery in the data-parallel frontend (`DPEngineClient`): restarting the ranks a
failure stopped and handing their unfinished requests out again (the behaviour: the
frontend's module docstring; the policy and the figures: `ElasticRecovery`).

`FrontendRecovery` is a mixin of `batchgen.distributed.frontend.DPEngineClient`; it uses the
client's ``config``, ``parallel``, ``rank_set``, ``_ranks``, ``requests``, ``recovery``,
``rebalancer``, ``_fatal``, ``_assign`` and ``_dispatch``.
"""

from __future__ import annotations

from batchgen.distributed.rank_set import RankFailedError, RankSet


class FrontendRecovery:
    """`DPEngineClient`'s recovery (see the module docstring)."""

    def _start_ranks(self) -> RankSet:
        """A new `RankSet`. A recoverable failure while it starts (a rank killed before
        connecting or while loading the model, or never connecting) is one more failure:
        `ElasticRecovery.begin` counts a restart for it and the ranks start again, or it raises.
        A set that failed to start has stopped its processes itself (`RankSet.__init__`)."""
        while True:
            try:
                return RankSet(self.config, self.parallel)
            except RankFailedError as failure:
                self.recovery.begin(failure, [], 0, len(self.requests))

    def _recover(self, failure: RankFailedError) -> None:
        """Outlive ``failure`` (the frontend's module docstring), or raise it (see
        `ElasticRecovery.begin`).

        The ranks it stopped (``failure.lost``: the restart groups of the ranks involved, or
        every rank) start again and get their unfinished requests back; the other ranks run
        on, with their requests. The outputs that arrived with the failure are taken first,
        so nothing finished is run twice. When ranks fail again while they start, every rank
        is started afresh (`_start_ranks`, within the same budget).

        Raises:
            RankFailedError: ``failure``, or the new ranks' last failure to start (not
                recoverable, or past the budget). Every later call raises it again, and every
                rank is stopped.
        """
        try:
            self._dispatch(self.rank_set.take_held())
            lost = failure.lost or [r.rank for r in self._ranks]
            survivors = len(self._ranks) - len(lost)
            self.recovery.begin(
                failure,
                [self._ranks[r] for r in lost],
                sum(self._ranks[r].done_tokens for r in lost),
                sum(1 for e in self.requests.values() if e.rank in lost),
                lost if survivors else None,
            )
            if survivors and not self.rank_set.closed:
                self.rank_set.replace(lost)  # returns at once: the new ranks join as they load
            else:
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
        self.recovery.requeue([i for i, _ in requeue], lost)
        self._check_recovered()

    def _check_recovered(self) -> None:
        """End the recovery under way once no rank started again is still joining, at the
        time the last one's `Ready` arrived (not when this frontend read it)."""
        if self.recovery.recovering and not self.rank_set.joining:
            restarted = [self._ranks[r] for r in self.recovery.restarted]
            times = [r.ready_at for r in restarted if r.ready_at is not None]
            self.recovery.end(len(restarted), max(times) if times else None)
