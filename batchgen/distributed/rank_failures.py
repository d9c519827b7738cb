"""How `RankSet` names and contains a rank failure (a mixin of `RankSet`): wait a moment for
the deaths to show, name the dead, then the stuck, then the ranks that failed on their own
(`name_failure`), and stop what the failure broke: with elastic recovery the restart groups of
the ranks at fault (the others run on), else every rank.

It uses `RankSet`'s ``ranks``, ``parallel``, ``failure``, ``_inbox``, ``_held``, ``_joining``,
``_can_replace`` and ``shutdown``, and `RankMessages`' ``_sort`` (rank_messages.py).
"""

from __future__ import annotations

import queue
import time

from batchgen.distributed import protocol as msg
from batchgen.distributed.layout import resolve_layout
from batchgen.distributed.rank_handle import RankFailedError, RankHandle, name_failure

# A rank whose heartbeat is this late when another rank fails is named stuck.
STUCK_AFTER_S = 3 * msg.HEARTBEAT_S


class RankFailures:
    """`RankSet`'s failure handling (see the module docstring)."""

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
        # not a rank retired for good by an earlier failure: its process ended then
        ended = {
            r.rank
            for r in self.ranks
            if r.process is not None and not r.retired and r.process.done()
        }
        self._read_last_words(broken, failed, got, ended)
        reporting = {r.rank for r, _ in failed}
        if failed and all(r.rank in reporting for r in broken) and not ended - reporting:
            self._tell_stuck_from_alive(reporting)  # nobody died: a peer may be stuck
            self._read_last_words(broken, failed, got, set())
        self._held += got
        for rank in self.ranks:
            if rank.rank in ended and rank not in broken:
                broken.append(rank)
        failure, involved = name_failure(self._watched(), broken, failed, STUCK_AFTER_S)
        self._fail_with(failure, involved)

    def _watched(self) -> list[RankHandle]:
        """The ranks whose heartbeats tell whether they are stuck: not a replacement that has
        not connected yet (its start is watched by `Joining`), nor a retired rank."""
        return [r for r in self.ranks if r.conn is not None and not r.retired]

    def _tell_stuck_from_alive(self, reporting: set[int]) -> None:
        """Wait until every other watched rank has either heartbeated since now (alive) or is
        over `STUCK_AFTER_S` late (stuck); at most `STUCK_AFTER_S` + `HEARTBEAT_S` seconds.

        A rank that reports an error from a collective (gloo's timeout, which is
        ``distributed_timeout_s``) may be the victim of a stopped peer whose heartbeats are not
        late enough yet to tell: the peer is the one to restart, and naming the reporter would
        end the job (an error raised on a rank is not retried). Healthy ranks heartbeat every
        `HEARTBEAT_S`, so this costs about a second when nobody is stuck."""
        since = time.monotonic()
        deadline = since + STUCK_AFTER_S + msg.HEARTBEAT_S
        while time.monotonic() < deadline:
            now = time.monotonic()
            if all(
                r.last_seen >= since or now - r.last_seen > STUCK_AFTER_S
                for r in self._watched()
                if r.rank not in reporting
            ):
                return
            time.sleep(0.1)

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

    def retire_for_good(self, lost: list[int]) -> None:
        """Leave ranks ``lost`` (whole restart groups, stopped by the failure that `receive`
        raised) out of the job for good and clear that failure. Their handles stay in
        ``ranks``, ``retired`` (their messages ignored, never sent to, never watched); what was
        queued for them is dropped (the frontend queues it elsewhere)."""
        self.failure = None
        for r in lost:
            self.ranks[r].pending, self.ranks[r].load = [], 0

    @property
    def retired_ranks(self) -> list[int]:
        """The ranks retired for good (a rank stopped and started again has a new handle)."""
        return [r.rank for r in self.ranks if r.retired]

    def _retire(self, ranks: list[RankHandle]) -> None:
        """Stop ``ranks`` at once (their group is broken) and stop listening to them."""
        self._joining.drop([r.rank for r in ranks])
        for rank in ranks:
            rank.retired = True
            if rank.process is not None:
                rank.process.kill()
        for rank in ranks:
            if rank.process is not None:
                rank.process.wait(10)
            close(rank)

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


def close(rank: RankHandle) -> None:
    """Close ``rank``'s mailbox, or its bare connection (accepted, never set up)."""
    if rank.mailbox is not None:
        rank.mailbox.close()
    elif rank.conn is not None:
        rank.conn.close()
