"""How `RankSet` talks to its ranks (a mixin of `RankSet`): `send` and `broadcast` queue
messages on the ranks' mailboxes, `receive` is the only way messages come in, and it is where
failures are found (a closed connection, `Failed`, a rank silent for ``distributed_timeout_s``,
a rank that holds up its group's start: see `rank_set`'s docstring).

It uses `RankSet`'s ``ranks``, ``parallel``, ``failure``, ``_inbox``, ``_held``, ``_joining``,
``start_took``, ``_take_joining`` and ``_joined_again``, and `RankFailures`' ``_fail`` and
``_fail_with``.
"""

from __future__ import annotations

import queue
import time

from batchgen.distributed import protocol as msg
from batchgen.distributed.mailbox import CLOSED
from batchgen.distributed.rank_handle import RankFailedError, RankHandle, silence, where

# A rank not ready yet may be silent this long at least (`RankMessages._silence_s`); ranks
# must also connect within it (`RankSet._connect_timeout`).
STARTING_SILENCE_S = 60.0


class RankMessages:
    """`RankSet`'s messaging (see the module docstring)."""

    def send(self, rank: RankHandle, message) -> None:
        """Queue ``message`` for ``rank``; never blocks (see `Mailbox`).

        Raises:
            RuntimeError: ``rank`` is started again and not connected yet (queue requests in
                its ``pending`` instead).
        """
        if rank.mailbox is None:
            raise RuntimeError(f"rank {rank.rank} is not connected yet")
        rank.mailbox.send(message)

    def broadcast(self, message) -> None:
        """Send ``message`` to every running rank (not to ranks started again and not ready
        yet)."""
        for rank in self.ranks:
            if not rank.joining and not rank.retired:
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
        if self._joining.active:
            self._take_joining()
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
        silent = [
            r
            for r in self.ranks
            if r.conn is not None and not r.retired and now - r.last_seen > self._silence_s(r)
        ]
        if silent:
            self._held += got
            ids = [r.rank for r in silent]
            text = "; ".join(silence(r, now) for r in silent)
            self._fail_with(RankFailedError(text, ids, recoverable=True), set(ids))
        lagging = self._loading_laggards(now)
        if lagging:
            self._held += got
            ids = [r.rank for r, _ in lagging]
            text = "; ".join(why for _, why in lagging)
            self._fail_with(RankFailedError(text, ids, recoverable=True), set(ids))
        return got

    def _silence_s(self, rank: RankHandle) -> float:
        """How long ``rank`` may go unheard before it is named stuck: ``distributed_timeout_s``,
        or while it starts (not ready yet: connecting, joining its groups, loading) at least
        `STARTING_SILENCE_S`, the bound of its connection (`RankSet._connect_timeout`). A rank
        that loads weights or touches its KV cache for the first time can miss heartbeats for
        seconds (measured: 4 s, a 1 GiB cache backed by huge pages in a VM, two ranks on two
        cores), and a short timeout is for hangs in steps."""
        timeout = self.parallel.distributed_timeout_s
        if rank.ready_at is None:
            return max(timeout, STARTING_SILENCE_S)
        return timeout

    def _loading_laggards(self, now: float) -> list[tuple[RankHandle, str]]:
        """Ranks that hold up the start: not ready yet while a rank ahead of them has been
        ahead for longer than ``max(distributed_timeout_s, STARTING_SILENCE_S, the time it
        took to get there)``. A rank is ahead when

        - a peer of their expert-parallel group waits for them (it reports `WAITING_FOR_PEERS`
          in a wait they have not begun, `RankHandle.waits`: the rendezvous, the all-to-all's
          setup, the end of the start, `RankContext.wait_for_peers`), or
        - a rank set up with them (the first start, or a restart group started again) has been
          ready: the frontend waits for every rank's `Ready`, so this bounds the start where
          no collective waits for them (experts replicated, or their whole group hangs), or
        - with none of those (all of them hang) and an earlier start of every rank to go by
          (ranks started again after a failure), that start's slowest rank: it is taken as
          ahead from their `Setup` plus its time (`RankSet.start_took`).

        A rank that hangs while starting but still heartbeats is not silent; without this its
        peers would wait at the rendezvous or in a start-up collective for the rendezvous's
        timeout (`groups.INIT_TIMEOUT_S`, 30 minutes), and the frontend for ever. Ranks load
        about the same weights and KV cache, so one that takes more than twice as long as
        the first to get there (and more than a minute longer) is named. Returns (rank, why)
        pairs."""
        if self.failure is not None:
            return []
        layout = self._joining.layout
        live = {r.rank: r for r in self.ranks if not r.retired and r.conn is not None}
        out = []
        for rank in live.values():
            if rank.ready_at is not None or rank.phase == msg.WAITING_FOR_PEERS:
                continue  # started, or blocked in a wait itself: its peers are not ahead
            ahead = [  # (a rank ahead, since when, what it did then)
                (
                    live[m],
                    live[m].waiting_since,
                    " of its expert-parallel group began waiting for it",
                )
                for m in layout.restart_group(rank.rank)
                if m in live
                and live[m].phase == msg.WAITING_FOR_PEERS
                and live[m].waits > rank.waits
                and live[m].set_up_at is not None
            ]
            ahead += [
                (r, r.ready_at, " was ready")
                for r in live.values()
                if r.ready_at is not None
                and rank.set_up_at is not None
                and r.set_up_at == rank.set_up_at
            ]
            if ahead:
                first, since, what = min(ahead, key=lambda a: a[1])
                took = since - first.set_up_at
                after = f"after rank {first.rank}{what}, {took:.0f} s into its start"
            elif self.start_took is not None and rank.set_up_at is not None:
                took = self.start_took
                since = rank.set_up_at + took
                after = f"longer than the job's last start took ({took:.0f} s)"
            else:
                continue
            bound = max(self.parallel.distributed_timeout_s, STARTING_SILENCE_S, took)
            lag = now - since
            if lag <= bound:
                continue
            why = (
                f"rank {rank.rank} ({where(rank)}) still {rank.phase} {lag:.0f} s {after} (a "
                f"rank may lag the first by max(distributed_timeout_s, "
                f"{STARTING_SILENCE_S:.0f} s, the first's time to get there) = {bound:.0f} s): "
                "stuck, or too slow, while starting"
            )
            out.append((rank, why))
        return out

    def _sort(self, rank: RankHandle, message, broken: list, failed: list, got: list) -> None:
        if rank.retired:
            return  # a rank replaced after a failure: its last words were read then
        if message is CLOSED:
            broken.append(rank)
        elif isinstance(message, msg.Failed):
            failed.append((rank, message.message))
        elif isinstance(message, msg.Ready) and rank.joining:
            self._joined_again(rank, message)
        elif not isinstance(message, msg.Heartbeat):
            got.append((rank, message))
