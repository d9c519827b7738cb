"""Ranks started again after a failure, on their way in while the other ranks run on
(`RankSet.replace`): which are still to connect, since when, and which restart groups are
whole, so that `RankSet` can set them up together without ever blocking the frontend."""

from __future__ import annotations

import queue
import time

from batchgen.distributed import protocol as msg
from batchgen.distributed.layout import ParallelLayout
from batchgen.distributed.rank_accept import check_started, take_hello
from batchgen.distributed.rank_handle import RankHandle
from batchgen.distributed.rank_process import RankProcess

Joined = dict[int, tuple[RankHandle, msg.Hello, str]]


class Joining:
    """The replacement ranks not connected yet, and those connected whose restart group is not
    whole yet (a group's ranks form one ``torch.distributed`` world, so they are set up
    together: `ParallelLayout.restart_group`)."""

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout = layout
        self.since: dict[int, float] = {}  # rank -> when it was started (time.monotonic)
        self.processes: dict[int, RankProcess] = {}
        self.joined: Joined = {}

    @property
    def active(self) -> bool:
        return bool(self.since)

    def add(self, ranks: list[int], processes: dict[int, RankProcess]) -> None:
        """Wait for ``ranks`` (whole restart groups), started as ``processes``."""
        now = time.monotonic()
        for r in ranks:
            self.drop([r])
            self.since[r] = now
            if r in processes:
                self.processes[r] = processes[r]

    def poll(
        self, arrived: queue.Queue, timeout: float, address: tuple[str, int]
    ) -> list[Joined]:
        """Take the connections that arrived (never waits for one) and return the restart
        groups now whole, forgetting them here.

        Raises:
            RankFailedError: a waiting rank ended before connecting or did not connect within
                ``timeout`` seconds (`check_started`).
        """
        while True:
            try:
                conn, peer = arrived.get_nowait()
            except queue.Empty:
                break
            waiting = set(self.since) - set(self.joined)
            take_hello(conn, peer, waiting, self.joined, self.processes)
        waiting = {r: t for r, t in self.since.items() if r not in self.joined}
        check_started(waiting, self.processes, timeout, address)
        whole = []
        for r in sorted(self.joined):
            group = self.layout.restart_group(r)
            if r == group[0] and all(m in self.joined for m in group):
                whole.append({m: self.joined[m] for m in group})
        for group in whole:
            for m in group:
                del self.joined[m], self.since[m]
                self.processes.pop(m, None)
        return whole

    def drop(self, ranks: list[int]) -> None:
        """Stop waiting for ``ranks`` (stopped again, or the set shuts down): close what
        connected of them."""
        for r in ranks:
            entry = self.joined.pop(r, None)
            if entry is not None:
                entry[0].conn.close()
            self.since.pop(r, None)
            self.processes.pop(r, None)
