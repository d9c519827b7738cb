"""Elastic recovery's policy and accounting: whether a rank failure may be outlived, by
starting the ranks again or by retiring them for good while the other groups run on, and what
the restarts cost (`DPEngineClient._recover` does the restart, the retirement and the
re-queuing; the frontend's module docstring describes the behaviour).

The rule (`ElasticRecovery.plan`), for the restart groups a recoverable failure stopped:

- a group is started again when this frontend started all of its ranks (local processes or
  Ray actors) and the engine has restarts left (`MAX_RECOVERIES` in all, failed restarts
  included, as before);
- otherwise (ranks of ``torchrun`` or of another machine's launcher, which this frontend
  cannot start; or the budget is spent, e.g. by restarts that keep failing, or a Ray node
  whose bundle is never placed again within the connect timeout) the group is *retired*: its
  ranks leave the job for good, its unfinished requests go to the groups left, and requests
  pinned to its ranks fail one by one; provided another group is left (running, or being
  started again by this same failure);
- the job fails only when no group would be left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from batchgen.distributed.rank_set import RankFailedError, RankHandle
from batchgen.parallel_config import ParallelConfig

logger = logging.getLogger(__name__)

# Restarts of the ranks one engine may take with enable_elastic_recovery before a failure ends
# the job (a request that kills its rank every time must not restart it forever).
MAX_RECOVERIES = 3


class ElasticRecovery:
    """Counts and bounds the restarts of one `DPEngineClient`.

    A failure while the ranks start (the first start, or a restart) is a failure like any
    other: `begin` counts one more restart for it, so a job outlives at most `MAX_RECOVERIES`
    failures in all, wherever they happen. `begin` ... `end` spans one recovery: from the first
    failure to the ranks running again, through restarts that failed meanwhile.

    Metrics (`metrics`), live: a recovery under way counts as far as it went.
    ``recoveries`` (restarts of the ranks, the failed ones included); ``ranks_retired`` (the
    ranks retired for good, in the order retired); ``requests_requeued``
    (requests handed out again, each counted once per recovery even when a restart failed in
    between); ``recovery_seconds`` (from the failure's report to the last new rank's `Ready`
    arriving, summed; for a recovery under way, until now); ``tokens_recomputed`` (prompt and
    generated tokens the lost ranks had computed for requests that had not finished, from
    their last heartbeats, so about: up to a second of work is missing); ``recovering`` (a
    recovery is under way) and ``ranks_joining`` (the ranks started again and not ready yet).
    """

    def __init__(self, parallel: ParallelConfig) -> None:
        self.parallel = parallel
        self.recoveries = 0
        self.requests_requeued = 0
        self.recovery_seconds = 0.0
        self.tokens_recomputed = 0
        self.ranks_retired: list[int] = []
        self._start: float | None = None  # when the recovery under way began
        self.requeued: set[str] = set()  # request ids handed out again by it
        self.restarted: set[int] = set()  # ranks started again by it

    @property
    def recovering(self) -> bool:
        """`begin` was called and `end` not yet (the ranks are being started again)."""
        return self._start is not None

    def plan(
        self,
        failure: RankFailedError,
        groups: list[list[int]],
        restartable: Callable[[list[int]], bool],
        others_left: bool,
    ) -> tuple[list[int], list[int]]:
        """Which of the stopped restart groups ``groups`` start again and which are retired
        for good (the rule in the module docstring). Counts nothing: `begin` counts a
        restart, `retire` a retirement.

        Args:
            failure: what stopped them (``failure.lost``: every rank of ``groups``).
            restartable: whether this frontend can start a group's ranks again.
            others_left: some rank outside ``groups`` is neither retired nor stopped (it
                runs, or is being started again after an earlier failure).

        Returns:
            (the ranks to start again, the ranks to retire), each in order.

        Raises:
            RankFailedError: ``failure`` itself when recovery is off or the fault is not
                recoverable (``failure.recoverable`` is False); when a group would be retired
                and no group would be left, a new error saying why it cannot start again
                (the budget spent: "gave up after N restarts"; or ranks started elsewhere).
        """
        if not (self.parallel.enable_elastic_recovery and failure.recoverable):
            raise failure
        within = self.recoveries < MAX_RECOVERIES
        restart = [r for g in groups if within and restartable(g) for r in g]
        retire = [r for g in groups if not (within and restartable(g)) for r in g]
        if retire and not (others_left or restart):
            if not within:
                why = f"gave up after {self.recoveries} restarts of the ranks"
            else:
                why = (
                    f"ranks {retire} were started by torchrun or on another machine, so this "
                    "frontend cannot start them again"
                )
            raise RankFailedError(
                f"{failure} (elastic recovery: {why}; no other group is left to run on)",
                failure.ranks,
            ) from failure
        return restart, retire

    def retire(self, ranks: list[RankHandle], done_tokens: int, why: str) -> None:
        """``ranks`` leave the job for good (see `plan`); ``done_tokens``: prompt + generated
        tokens of the outputs they returned (their other work is recomputed elsewhere);
        ``why``: for the log line."""
        self.tokens_recomputed += _lost_work(ranks, done_tokens)
        self.ranks_retired += [r.rank for r in ranks]
        logger.warning(
            "elastic recovery: ranks %s retired for good (%s); the other groups run on "
            "with their unfinished requests",
            [r.rank for r in ranks],
            why,
        )

    def begin(
        self,
        failure: RankFailedError,
        ranks: list[RankHandle],
        done_tokens: int,
        unfinished: int,
        only: list[int] | None = None,
    ) -> None:
        """Allow a restart after ``failure`` and count it, or raise.

        Args:
            ranks: the stopped ranks (their last heartbeat counters); none for a set that
                failed while starting.
            done_tokens: prompt + generated tokens of the outputs those ranks returned.
            unfinished: requests about to be re-queued (for the log line).
            only: the ranks started again while the others run on (None: all of them).

        Raises:
            RankFailedError: ``failure`` itself when recovery is off, when the fault is an error
                raised on a rank or a rank's exit with an error code while starting (a restart
                would repeat either: ``failure.recoverable`` is False), or, for a restart of
                every rank (``only`` None), when some ranks were started elsewhere (this
                frontend cannot start them again; `plan` has checked ``only``'s groups); a new
                error saying so after `MAX_RECOVERIES` restarts (failed restarts count).
        """
        p = self.parallel
        local = only is not None or p.data_parallel_size_local in (None, p.data_parallel_size)
        if not (p.enable_elastic_recovery and failure.recoverable and local):
            raise failure
        if self.recoveries >= MAX_RECOVERIES:
            raise RankFailedError(
                f"{failure} (elastic recovery: gave up after {self.recoveries} restarts of the "
                "ranks)",
                failure.ranks,
            ) from failure
        if self._start is None:  # else a restart failed: the same recovery goes on
            self._start = time.monotonic()
        self.tokens_recomputed += _lost_work(ranks, done_tokens)
        self.recoveries += 1
        which = "the ranks" if only is None else f"ranks {only} (the others run on)"
        logger.warning(
            "%s; elastic recovery %d of %d: starting %s again and re-queuing %d unfinished "
            "request(s)",
            failure,
            self.recoveries,
            MAX_RECOVERIES,
            which,
            unfinished,
        )

    def requeue(self, request_ids: list[str], ranks: list[int]) -> None:
        """The recovery under way started ``ranks`` again and handed ``request_ids`` out
        again (a request re-queued by two failed restarts counts once). With no restart
        under way (ranks retired only) they count at once."""
        if self._start is None:
            self.requests_requeued += len(set(request_ids))
            return
        self.requeued.update(request_ids)
        self.restarted.update(ranks)

    def end(self, num_ranks: int, ready_at: float | None = None) -> None:
        """``num_ranks`` new ranks run (the last one ready at ``ready_at``, `time.monotonic`;
        None: now): count the recovery's time since its first `begin` and its re-queued
        requests."""
        end = time.monotonic() if ready_at is None else ready_at
        seconds = max(0.0, end - self._start)
        self._start = None
        self.recovery_seconds += seconds
        self.requests_requeued += len(self.requeued)
        self.requeued, self.restarted = set(), set()
        logger.warning(
            "elastic recovery: %d rank(s) running again after %.1f s", num_ranks, seconds
        )

    def metrics(self, joining: list[int] = ()) -> dict:
        """The figures of the class docstring; ``joining``: the ranks not ready yet."""
        under_way = 0.0 if self._start is None else time.monotonic() - self._start
        return {
            "recoveries": self.recoveries,
            "requests_requeued": self.requests_requeued + len(self.requeued),
            "recovery_seconds": self.recovery_seconds + under_way,
            "tokens_recomputed": self.tokens_recomputed,
            "recovering": self.recovering,
            "ranks_joining": list(joining),
            "ranks_retired": list(self.ranks_retired),
        }


def _lost_work(ranks: list[RankHandle], done_tokens: int) -> int:
    """Prompt + generated tokens ``ranks`` computed (their last heartbeats) less those of the
    outputs they returned (``done_tokens``): work on unfinished requests, done again."""
    worked = sum(
        r.counters.get("num_prompt_tokens", 0) + r.counters.get("num_generated_tokens", 0)
        for r in ranks
    )
    return max(0, worked - done_tokens)
