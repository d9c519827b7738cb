"""Straggler rebalancing: moving requests from overloaded data-parallel ranks to idle ones.

Assignment at admission (`DPEngineClient._assign`) cannot know how long a request will run, so
one rank can end up with the long requests and finish long after the others (a *straggler*).
With ``straggler_rebalance_interval_steps = K`` the frontend moves work while the job runs:

1. **Loads.** Every K steps, a rank with unfinished requests sends `Load`: per request, its
   remaining tokens (prompt and generated tokens not yet computed, plus ``max_tokens`` not yet
   generated: an upper bound for requests that may stop early), the tokens whose K/V it holds,
   and whether it runs; and its free KV cache tokens. A request the rank has not reported yet
   counts with its admission estimate (prompt + ``max_tokens``, times ``n``).
2. **Decision** (`plan_moves`, on the frontend, deterministic: the same loads give the same
   moves). A rank's load is the sum of its requests' remaining tokens. While the most loaded
   rank ``src`` exceeds the least loaded ``dst`` by more than ``max(MIN_GAP_TOKENS,
   MIN_GAP_SHARE x load(src))``, move the request of ``src`` that minimises the pair's new peak
   ``max(load(src) - remaining, load(dst) + remaining + price)``, provided that peak is below
   ``load(src)``: ``price`` is what bringing a started request's K/V to ``dst`` costs there, in
   tokens of work (below). Ties go to the cheaper request, then to the earlier one. A started
   request moves only to a rank with room for its K/V (its last report's free KV tokens; a rank
   without requests counts as free). Pinned requests (``data_parallel_rank``) and requests
   already moving never move. **Within an expert-parallel group only waiting requests move**:
   the group's ranks step together and share every step's expert work, so the skew costs little
   (a skewed job took 1.01x and 1.11x the balanced one's time), while moving started requests
   made it slower, by recompute (1.27x) and even with their K/V shipped and nothing recomputed
   (1.18x; why is not yet known; docs/distributed.md). Started requests move between groups
   and between independent ranks. If ``src`` has no such request, the next most loaded rank
   is tried. A rank started again after a failure is no destination until it is ready
   (`DPEngineClient._choosable`); then the next round can fill it.
3. **Moving.** The frontend asks each source rank to `Release` its requests; the rank takes
   them out of its scheduler (freeing their KV blocks) and answers `Released` with each one's
   progress (`batchgen.engine.migration.RequestState`); the frontend queues each on its
   destination (`AddRequests` with the state). A waiting request that never started moves as
   metadata (the prompt and parameters the frontend keeps); a started one moves with its K/V
   shipped or by recompute (below), and continues decoding with the sample's seeded generator
   state, logprobs and text carried over, so the final output is the unmoved one. ``n`` > 1
   requests move whole. One round is in flight at a time.

**Ship or recompute** (`KVPrice`). Shipping a started request's K/V sends
``computed x kv_bytes_per_token`` bytes (source rank -> frontend -> destination, in the
`Released` and `AddRequests` messages); recomputing costs the destination ``computed`` tokens
of prefill. Both are linear in ``computed``, so the rule is per job, not per request: ship when
sending one token's K/V takes less time than computing it, ``kv_bytes_per_token x
tokens_per_s < link_bytes_per_s``, where ``tokens_per_s`` is the ranks' mean measured tokens per
busy second (their `Load` reports) and ``link_bytes_per_s`` the best rate measured on the moves
so far (bytes released over the seconds from `Release` sent to `Released` received, which
includes waiting for the rank's step to end, so it errs low), starting at
`DEFAULT_LINK_BYTES_PER_S`. A shipped request's ``price`` is ``computed x kv_bytes_per_token x
tokens_per_s / link_bytes_per_s`` tokens; a recomputed one's is ``computed``. On this project's
CPU machines shipping wins by far: the bench model's K/V is 16 KiB per token and a rank computes
a few thousand tokens per second (a few tens of MB/s), while a local pipe moves GB/s.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from batchgen.distributed import protocol as msg
from batchgen.distributed.rank_handle import RankHandle

logger = logging.getLogger(__name__)

# A pair of ranks is rebalanced only while their loads differ by more than this many tokens
# and by more than this share of the busier one's load (hysteresis: no churn over noise).
MIN_GAP_TOKENS = 64
MIN_GAP_SHARE = 0.1
# The link rate assumed before any move was measured: conservative for ranks on one machine
# (local pipes, GB/s) and about a 1 Gb/s Ethernet carrying the K/V twice (rank -> frontend ->
# rank) across machines.
DEFAULT_LINK_BYTES_PER_S = 100e6


@dataclass
class Candidate:
    """A request that may move: on ``rank``, ``remaining`` tokens of work left, ``computed``
    tokens of K/V there; ``ship``: a move sends that K/V (else the destination recomputes it);
    ``price``: what the move costs the destination in tokens of work (default ``computed``,
    the recompute)."""

    request_id: str
    rank: int
    remaining: int
    computed: int
    ship: bool = False
    price: float | None = None

    def __post_init__(self) -> None:
        if self.price is None:
            self.price = float(self.computed)


@dataclass
class Move:
    request_id: str
    src: int
    dst: int


def plan_moves(
    loads: list[float],
    free_kv_tokens: list[int | None],
    candidates: list[Candidate],
    groups: list[int] | None = None,
    joining: set[int] | frozenset[int] = frozenset(),
) -> list[Move]:
    """The moves of one rebalancing round (the rule in the module docstring).

    Args:
        loads: remaining tokens per rank (index = rank).
        free_kv_tokens: per rank, free KV tokens from its last report, None for no limit.
        candidates: the movable requests, in arrival order (ties go to the earlier one).
        groups: per rank, its expert-parallel group (ranks that step together); None: every
            rank steps on its own.
        joining: ranks started again after a failure and not ready yet: never a destination
            (their requests are not candidates either: they are not on a rank yet).

    Returns:
        The moves, in the order chosen; each request at most once.
    """
    loads = list(loads)
    groups = groups or list(range(len(loads)))
    lockstep = {g: groups.count(g) > 1 for g in groups}
    free = list(free_kv_tokens)
    by_rank: dict[int, list[Candidate]] = {}
    for c in candidates:
        by_rank.setdefault(c.rank, []).append(c)
    moves: list[Move] = []
    destinations = [r for r in range(len(loads)) if r not in joining]
    while destinations:
        dst = min(destinations, key=lambda r: (loads[r], r))
        best: tuple[tuple, Candidate, int] | None = None
        for src in sorted(range(len(loads)), key=lambda r: (-loads[r], r)):
            gap = loads[src] - loads[dst]
            if gap <= max(MIN_GAP_TOKENS, MIN_GAP_SHARE * loads[src]):
                break  # the ranks after this one are closer still
            same_group = groups[src] == groups[dst] and lockstep[groups[src]]
            for i, c in enumerate(by_rank.get(src, ())):
                if c.computed and free[dst] is not None and c.computed > free[dst]:
                    continue
                if c.computed and same_group:
                    continue  # costs the whole group more than the skew does (docstring)
                peak = max(loads[src] - c.remaining, loads[dst] + c.remaining + c.price)
                if peak >= loads[src]:
                    continue
                key = (peak, c.price, i)
                if best is None or key < best[0]:
                    best = (key, c, src)
            if best is not None:
                break
        if best is None:
            break
        _, c, src = best
        by_rank[src].remove(c)
        loads[src] -= c.remaining
        loads[dst] += c.remaining + c.price
        if c.computed and free[dst] is not None:
            free[dst] -= c.computed
        moves.append(Move(c.request_id, src, dst))
    return moves


class KVPrice:
    """Ship or recompute a moved request's K/V (the rule in the module docstring), from the
    ranks' `Load` reports (K/V bytes per token, tokens per busy second) and the link rate
    measured on the moves so far (bytes/s). ``policy``: ``"auto"`` (the rule), or
    ``"ship"`` / ``"recompute"`` always (for benchmarks and tests)."""

    def __init__(self, policy: str = "auto") -> None:
        if policy not in ("auto", "ship", "recompute"):
            raise ValueError(f"policy must be 'auto', 'ship' or 'recompute', got {policy!r}")
        self.policy = policy
        self.kv_bytes_per_token = 0
        self.tokens_per_s: dict[int, float] = {}
        self.link_bytes_per_s = DEFAULT_LINK_BYTES_PER_S
        self._measured = False

    def note_load(self, rank: int, load: msg.Load) -> None:
        self.kv_bytes_per_token = load.kv_bytes_per_token
        if load.tokens_per_s > 0:
            self.tokens_per_s[rank] = load.tokens_per_s

    def note_transfer(self, nbytes: int, seconds: float) -> None:
        """A `Released` of ``nbytes`` came ``seconds`` after its `Release` was sent."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self.link_bytes_per_s = max(self.link_bytes_per_s, rate) if self._measured else rate
        self._measured = True

    @property
    def compute_bytes_per_s(self) -> float:
        """K/V bytes the ranks compute per second (mean rank rate x bytes per token)."""
        rates = list(self.tokens_per_s.values())
        return self.kv_bytes_per_token * (sum(rates) / len(rates) if rates else 0.0)

    @property
    def ship(self) -> bool:
        """Sending a token's K/V is faster than computing it."""
        if self.policy != "auto":
            return self.policy == "ship"
        return self.compute_bytes_per_s < self.link_bytes_per_s

    def price(self, computed: int) -> float:
        """What moving ``computed`` tokens of K/V costs the destination, in tokens of work."""
        if not self.ship:
            return float(computed)
        return computed * self.compute_bytes_per_s / self.link_bytes_per_s


@dataclass
class RebalanceMetrics:
    """What rebalancing did (`DPEngineClient.get_metrics`): rounds with at least one move,
    requests and sequences moved, of which started (their K/V shipped or recomputed), the K/V
    tokens the destinations recompute, the K/V tokens and bytes shipped instead, all bytes the
    sources released (progress and K/V), and the link rate the ship-or-recompute rule uses."""

    rebalance_rounds: int = 0
    requests_moved: int = 0
    sequences_moved: int = 0
    requests_moved_by_recompute: int = 0
    requests_moved_with_kv: int = 0
    rebalance_tokens_recomputed: int = 0
    rebalance_kv_tokens_shipped: int = 0
    rebalance_kv_bytes_shipped: int = 0
    rebalance_bytes_shipped: int = 0
    rebalance_link_bytes_per_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(vars(self))


class Rebalancer:
    """The frontend's side of rebalancing (module docstring): it takes the ranks' `Load`
    reports, plans rounds (`plan_moves`), asks the sources to `Release`, and queues what they
    release on the destinations. ``client``: the `DPEngineClient` whose requests and ranks it
    moves; ``expert_parallel_size``: ranks per group that step together (1: independent).
    ``releases``: the round in flight, source rank -> (token, request id -> destination, when
    the `Release` was sent); ``free_kv``: rank -> free KV tokens at its last report;
    ``kv_price``: the ship-or-recompute rule's measurements."""

    def __init__(self, client, expert_parallel_size: int = 1) -> None:
        self.client = client
        self.expert_parallel_size = expert_parallel_size
        self.metrics = RebalanceMetrics()
        self._token = itertools.count()
        self.releases: dict[int, tuple[int, dict[str, int], float]] = {}
        self.free_kv: dict[int, int] = {}
        self.kv_price = KVPrice()

    def forget(self, ranks: list[int]) -> None:
        """Forget what ``ranks`` reported and the releases asked of them (they were stopped
        after a failure and started again; their requests start over). A release asked of a
        rank that runs on still lands, on a replaced destination too."""
        for r in ranks:
            self.releases.pop(r, None)
            self.free_kv.pop(r, None)  # its measured rate stays: the same hardware

    def reset_metrics(self) -> None:
        self.metrics = RebalanceMetrics()

    def note_load(self, rank: RankHandle, load: msg.Load) -> None:
        """Take a rank's `Load` report, then start a rebalancing round if none is in flight."""
        c = self.client
        self.free_kv[rank.rank] = load.free_kv_tokens
        self.kv_price.note_load(rank.rank, load)
        for request_id, remaining, computed, _running in load.requests:
            entry = c.requests.get(request_id)
            if entry is not None and entry.rank == rank.rank and not entry.moving:
                entry.remaining, entry.computed = remaining, computed
        if not self.releases:
            self.plan()

    def plan(self) -> None:
        """Plan a round of moves (`plan_moves`) and ask the source ranks to release them."""
        c = self.client
        loads = [0.0] * len(c._ranks)
        busy: set[int] = set()
        candidates = []
        ship, price = self.kv_price.ship, self.kv_price.price
        for request_id, entry in c.requests.items():
            loads[entry.rank] += entry.remaining
            busy.add(entry.rank)
            # a rank started again after a failure holds its requests until it is ready
            if entry.pinned is None and not entry.moving and not c._ranks[entry.rank].joining:
                candidates.append(
                    Candidate(
                        request_id,
                        entry.rank,
                        entry.remaining,
                        entry.computed,
                        ship=ship,
                        price=price(entry.computed),
                    )
                )
        free = [self.free_kv.get(r) if r in busy else None for r in range(len(c._ranks))]
        groups = [r // self.expert_parallel_size for r in range(len(c._ranks))]
        joining = {r.rank for r in c._ranks if r.joining or r.retired}  # not destinations
        moves = plan_moves(loads, free, candidates, groups, joining)
        if not moves:
            return
        for rank in c._ranks:  # a request still queued here must reach its rank first
            c._flush(rank)
        by_src: dict[int, dict[str, int]] = {}
        for move in moves:
            by_src.setdefault(move.src, {})[move.request_id] = move.dst
            c.requests[move.request_id].moving = True
        for src, targets in by_src.items():
            token = next(self._token)
            self.releases[src] = (token, targets, time.perf_counter())
            # All of them, not only those reported started: a waiting one may start meanwhile.
            shipped = list(targets) if ship else []
            c.rank_set.send(c._ranks[src], msg.Release(token, list(targets), shipped))
        self.metrics.rebalance_rounds += 1
        logger.debug("rebalancing: %s (loads %s, ship K/V: %s)", moves, loads, ship)

    def land(self, rank: RankHandle, released: msg.Released) -> None:
        """Queue what ``rank`` released on the chosen destinations."""
        c = self.client
        token, targets, sent_at = self.releases.get(rank.rank, (None, {}, 0.0))
        if token != released.token:
            return  # from a rank replaced by a recovery
        del self.releases[rank.rank]
        m = self.metrics
        m.rebalance_bytes_shipped += released.state_bytes
        kv_bytes = sum(state.kv_bytes for state in released.states.values())
        if kv_bytes:
            self.kv_price.note_transfer(released.state_bytes, time.perf_counter() - sent_at)
        m.rebalance_link_bytes_per_s = self.kv_price.link_bytes_per_s
        touched = set()
        for request_id, dst in targets.items():
            entry = c.requests.get(request_id)
            if entry is None:
                continue  # aborted meanwhile (its state, if any, is dropped)
            entry.moving = False
            state = released.states.get(request_id)
            if state is None:
                continue  # not on the rank any more (it failed there): nothing moves
            rank.load -= entry.load
            started = state.started
            m.requests_moved += 1
            m.sequences_moved += sum(not s.finished for s in state.seqs)
            shipped = state.num_shipped_tokens
            if shipped:
                m.requests_moved_with_kv += 1
                m.rebalance_kv_tokens_shipped += shipped
                m.rebalance_kv_bytes_shipped += state.kv_bytes
            elif started:
                m.requests_moved_by_recompute += 1
            m.rebalance_tokens_recomputed += state.num_computed_tokens - shipped
            entry.remaining += entry.computed - shipped
            entry.computed = shipped
            # a destination stopped by a failure since is starting again: a ready rank instead
            to = None if c._ranks[dst].joining or c._ranks[dst].retired else dst
            c._assign(request_id, entry, to, state if started else None)
            touched.add(entry.rank)
        for dst in sorted(touched):
            c._flush(c._ranks[dst])
