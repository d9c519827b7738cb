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


@dataclass
class RankHandle:
    """The frontend's view of one rank: its connection and process, what its heartbeats say,
    and the requests queued for it (``load``: their estimated tokens)."""

    rank: int
    conn: Connection
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

    def note(self, message: object) -> None:
        """Called by the mailbox's reader thread for each message, as it arrives."""
        self.last_seen = time.monotonic()
        if isinstance(message, msg.Heartbeat):
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
