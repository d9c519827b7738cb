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
   ``max(load(src) - remaining, load(dst) + remaining + computed)``, provided that peak is below
   ``load(src)``: ``computed`` is the recompute the move costs ``dst`` (a started request's K/V
   is rebuilt there, at one token of work per token, a conservative price: a prefill token is
   cheaper than a decode token). Ties go to the request with less to recompute, then to the
   earlier request. A started request moves only to a rank with room for its K/V (its last
   report's free KV tokens; a rank without requests counts as free). Pinned requests
   (``data_parallel_rank``) and requests already moving never move. If ``src`` has no such
   request, the next most loaded rank is tried.
3. **Moving.** The frontend asks each source rank to `Release` its requests; the rank takes
   them out of its scheduler (freeing their KV blocks) and answers `Released` with each one's
   progress (`batchgen.engine.migration.RequestState`); the frontend queues each on its
   destination (`AddRequests` with the state). A waiting request that never started moves as
   metadata (the prompt and parameters the frontend keeps); a started one moves by recompute:
   the destination prefills its prompt and generated tokens, then continues decoding with the
   sample's seeded generator state, logprobs and text carried over, so the final output is the
   unmoved one. ``n`` > 1 requests move whole. One round is in flight at a time.

KV shipping (sending a started request's K/V blocks point to point instead of recomputing
them) is not built. The rule it would use: ship when ``kv_bytes / link_bytes_per_s <
computed_tokens / prefill_tokens_per_s`` of the destination, both measured (the all-to-all's
bytes and seconds, the rank's prefill throughput); on the CPU machines this was written on
the recompute side wins for short contexts, so recompute alone was built first.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from batchgen.distributed import protocol as msg
from batchgen.distributed.rank_handle import RankHandle

logger = logging.getLogger(__name__)

# A pair of ranks is rebalanced only while their loads differ by more than this many tokens
# and by more than this share of the busier one's load (hysteresis: no churn over noise).
MIN_GAP_TOKENS = 64
MIN_GAP_SHARE = 0.1


@dataclass
class Candidate:
    """A request that may move: on ``rank``, ``remaining`` tokens of work left, ``computed``
    tokens of K/V there (what a move recomputes)."""

    request_id: str
    rank: int
    remaining: int
    computed: int


@dataclass
class Move:
    request_id: str
    src: int
    dst: int


def plan_moves(
    loads: list[int], free_kv_tokens: list[int | None], candidates: list[Candidate]
) -> list[Move]:
    """The moves of one rebalancing round (the rule in the module docstring).

    Args:
        loads: remaining tokens per rank (index = rank).
        free_kv_tokens: per rank, free KV tokens from its last report, None for no limit.
        candidates: the movable requests, in arrival order (ties go to the earlier one).

    Returns:
        The moves, in the order chosen; each request at most once.
    """
    loads = list(loads)
    free = list(free_kv_tokens)
    by_rank: dict[int, list[Candidate]] = {}
    for c in candidates:
        by_rank.setdefault(c.rank, []).append(c)
    moves: list[Move] = []
    while True:
        dst = min(range(len(loads)), key=lambda r: (loads[r], r))
        best: tuple[tuple, Candidate, int] | None = None
        for src in sorted(range(len(loads)), key=lambda r: (-loads[r], r)):
            gap = loads[src] - loads[dst]
            if gap <= max(MIN_GAP_TOKENS, MIN_GAP_SHARE * loads[src]):
                break  # the ranks after this one are closer still
            for i, c in enumerate(by_rank.get(src, ())):
                if c.computed and free[dst] is not None and c.computed > free[dst]:
                    continue
                peak = max(loads[src] - c.remaining, loads[dst] + c.remaining + c.computed)
                if peak >= loads[src]:
                    continue
                key = (peak, c.computed, i)
                if best is None or key < best[0]:
                    best = (key, c, src)
            if best is not None:
                break
        if best is None:
            return moves
        _, c, src = best
        by_rank[src].remove(c)
        loads[src] -= c.remaining
        loads[dst] += c.remaining + c.computed
        if c.computed and free[dst] is not None:
            free[dst] -= c.computed
        moves.append(Move(c.request_id, src, dst))


@dataclass
class RebalanceMetrics:
    """What rebalancing did (`DPEngineClient.get_metrics`): rounds with at least one move,
    requests and sequences moved, of which started (moved by recompute), the K/V tokens the
    sources dropped and the destinations recompute, and the bytes of progress shipped."""

    rebalance_rounds: int = 0
    requests_moved: int = 0
    sequences_moved: int = 0
    requests_moved_by_recompute: int = 0
    rebalance_tokens_recomputed: int = 0
    rebalance_bytes_shipped: int = 0

    def as_dict(self) -> dict:
        return dict(vars(self))


class Rebalancer:
    """The frontend's side of rebalancing (module docstring): it takes the ranks' `Load`
    reports, plans rounds (`plan_moves`), asks the sources to `Release`, and queues what they
    release on the destinations. ``client``: the `DPEngineClient` whose requests and ranks it
    moves. ``releases``: the round in flight, source rank -> (token, request id -> destination);
    ``free_kv``: rank -> free KV tokens at its last report."""

    def __init__(self, client) -> None:
        self.client = client
        self.metrics = RebalanceMetrics()
        self._token = itertools.count()
        self.releases: dict[int, tuple[int, dict[str, int]]] = {}
        self.free_kv: dict[int, int] = {}

    def reset(self) -> None:
        """Forget the round in flight and the loads (the ranks were replaced)."""
        self.releases, self.free_kv = {}, {}

    def reset_metrics(self) -> None:
        self.metrics = RebalanceMetrics()

    def note_load(self, rank: RankHandle, load: msg.Load) -> None:
        """Take a rank's `Load` report, then start a rebalancing round if none is in flight."""
        c = self.client
        self.free_kv[rank.rank] = load.free_kv_tokens
        for request_id, remaining, computed, _running in load.requests:
            entry = c.requests.get(request_id)
            if entry is not None and entry.rank == rank.rank and not entry.moving:
                entry.remaining, entry.computed = remaining, computed
        if not self.releases:
            self.plan()

    def plan(self) -> None:
        """Plan a round of moves (`plan_moves`) and ask the source ranks to release them."""
        c = self.client
        loads = [0] * len(c._ranks)
        busy: set[int] = set()
        candidates = []
        for request_id, entry in c.requests.items():
            loads[entry.rank] += entry.remaining
            busy.add(entry.rank)
            if entry.pinned is None and not entry.moving:
                candidates.append(
                    Candidate(request_id, entry.rank, entry.remaining, entry.computed)
                )
        free = [self.free_kv.get(r) if r in busy else None for r in range(len(c._ranks))]
        moves = plan_moves(loads, free, candidates)
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
            self.releases[src] = (token, targets)
            c.rank_set.send(c._ranks[src], msg.Release(token, list(targets)))
        self.metrics.rebalance_rounds += 1
        logger.debug("rebalancing: %s (loads %s)", moves, loads)

    def land(self, rank: RankHandle, released: msg.Released) -> None:
        """Queue what ``rank`` released on the chosen destinations."""
        c = self.client
        token, targets = self.releases.get(rank.rank, (None, {}))
        if token != released.token:
            return  # from ranks replaced by a recovery
        del self.releases[rank.rank]
        m = self.metrics
        m.rebalance_bytes_shipped += released.state_bytes
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
            if started:
                m.requests_moved_by_recompute += 1
                m.rebalance_tokens_recomputed += state.num_computed_tokens
            entry.remaining += entry.computed
            entry.computed = 0
            c._assign(request_id, entry, dst, state if started else None)
            touched.add(dst)
        for dst in sorted(touched):
            c._flush(c._ranks[dst])
