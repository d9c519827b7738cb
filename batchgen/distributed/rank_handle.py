"""The frontend's record of one rank (`RankHandle`), the error a rank failure raises
(`RankFailedError`), and how failure reports name a rank."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from batchgen.distributed import protocol as msg
from batchgen.distributed.mailbox import Mailbox
from batchgen.distributed.rank_process import RankProcess


class RankFailedError(RuntimeError):
    """A rank died, failed or went silent. ``ranks``: the ranks at fault. ``recoverable``: the
    fault is a rank's death or silence (a machine or process lost, which a restart of the ranks
    can outlive), while the job ran or while the ranks started (killed before connecting,
    never connecting, dying while loading the model), not an error raised on a rank nor a rank
    that exited with an error code while starting (a restart would repeat either)."""

    def __init__(self, message: str, ranks: list[int], recoverable: bool = False) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.recoverable = recoverable
        # The ranks this failure stopped (set by `RankSet`): every rank, or, when the others
        # run on for elastic recovery, the restart groups of the ranks involved.
        self.lost: list[int] = []


@dataclass
class RankHandle:
    """The frontend's view of one rank: its connection and process, what its heartbeats say,
    and the requests queued for it (``load``: their estimated tokens). A rank started again
    after a failure is ``joining`` until it is ready: first without a connection (``conn``
    None), then set up and loading; what is queued for it waits in ``pending``."""

    rank: int
    conn: Connection | None
    host: str
    pid: int
    process: RankProcess | None = None  # a rank this frontend started
    node_id: str | None = None  # its Ray node, under the ray executor
    load: int = 0  # estimated tokens of its unfinished requests
    unfinished: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    step_id: int = 0
    phase: str = "starting"
    pending: list = field(default_factory=list)
    counters: dict = field(default_factory=dict)  # from its last heartbeat
    mailbox: Mailbox | None = None  # sends and receives in background threads, once accepted
    done_tokens: int = 0  # prompt + generated tokens of the outputs it returned
    # stopped after a failure (its messages are ignored): replaced in `RankSet.ranks` by a new
    # handle when its group starts again, left there when the group is retired for good
    retired: bool = False
    joining: bool = False  # started again after a failure, not ready yet
    ready_at: float | None = None  # when its `Ready` arrived (time.monotonic)
    # when it was sent `Setup` (it starts loading then; the same for ranks set up together)
    set_up_at: float | None = None
    # the waits for its group's ranks it has begun while starting (`WAITING_FOR_PEERS` after
    # another phase: the rendezvous, the all-to-all's setup, the end of its start), and when
    # it began the last one
    waits: int = 0
    waiting_since: float | None = None

    def note(self, message: object) -> None:
        """Called by the mailbox's reader thread for each message, as it arrives."""
        self.last_seen = time.monotonic()
        if isinstance(message, msg.Ready):
            self.ready_at = self.last_seen
        elif isinstance(message, msg.Heartbeat):
            if message.phase == msg.WAITING_FOR_PEERS and self.phase != msg.WAITING_FOR_PEERS:
                self.waits, self.waiting_since = self.waits + 1, self.last_seen
            self.step_id, self.phase = message.step_id, message.phase
            self.counters = message.counters


def where(rank: RankHandle) -> str:
    """``pid 1234 on host`` (and its Ray node, under Ray)."""
    node = f", Ray node {rank.node_id[:8]}" if rank.node_id else ""
    return f"pid {rank.pid} on {rank.host}{node}"


def silence(rank: RankHandle, now: float) -> str:
    """A silent rank, for a failure report."""
    return (
        f"rank {rank.rank} ({where(rank)}) silent for "
        f"{now - rank.last_seen:.0f} s (last seen at step {rank.step_id}, {rank.phase}): "
        "stuck or stopped"
    )


def describe_end(rank: RankHandle) -> str:
    """How a rank whose connection closed ended, as far as its `RankProcess` knows."""
    return "its connection closed" if rank.process is None else rank.process.describe()


def name_failure(
    ranks: list[RankHandle],
    broken: list[RankHandle],
    failed: list[tuple[RankHandle, str]],
    stuck_after_s: float,
) -> tuple[RankFailedError, set[int]]:
    """The error for a failure: the dead first (``broken``: connections closed, less the
    ranks that reported `Failed`, which exit by themselves after reporting), then the ranks
    whose heartbeats are over ``stuck_after_s`` late (stuck), then the ranks that failed on
    their own (``failed``: rank and its report). It is recoverable when someone died or is
    stuck (a peer's death seen from a collective is then not the cause).

    Returns:
        the error (its ``ranks``: the culprits) and every rank involved (the dead, the stuck
        and the reporting).
    """
    reported = {r.rank for r, _ in failed}
    dead = sorted(
        {r.rank: r for r in broken if r.rank not in reported}.values(), key=lambda r: r.rank
    )
    parts = [f"rank {r.rank} ({where(r)}) died: {describe_end(r)}" for r in dead]
    now = time.monotonic()
    culprit_ids = {r.rank for r in dead}
    stuck = [r for r in ranks if r.rank not in culprit_ids and now - r.last_seen > stuck_after_s]
    parts += [silence(r, now) for r in stuck]
    culprit_ids |= {r.rank for r in stuck}
    for rank, text in failed:
        if rank.rank not in culprit_ids:
            first = text.strip().splitlines()[0] if text.strip() else "unknown error"
            parts.append(f"rank {rank.rank} failed: {first}")
    culprits = sorted(culprit_ids) or sorted(reported)
    failure = RankFailedError("; ".join(parts), culprits, recoverable=bool(culprit_ids))
    return failure, {r.rank for r in broken} | reported | culprit_ids
