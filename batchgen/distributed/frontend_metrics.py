"""The metrics surface of the data-parallel frontend (`DPEngineClient`): job metrics by a
round trip to every rank, and live figures from the ranks' heartbeats.

`FrontendMetrics` is a mixin of `batchgen.distributed.frontend.DPEngineClient`; it uses the
client's rank set, ranks, recovery and rebalancer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from batchgen.distributed import protocol as msg
from batchgen.distributed.frontend_recovery import locked
from batchgen.distributed.metrics import aggregate_metrics
from batchgen.distributed.rank_set import RankFailedError


@dataclass
class _KVUsage:
    usage: float


class FrontendMetrics:
    """`LLMEngine`'s metrics methods for a data-parallel job (see the module docstring)."""

    @locked
    def get_metrics(self) -> dict:
        """Every rank's `LLMEngine.get_metrics` (``ranks``) plus job totals (`aggregate_metrics`:
        tokens summed, rates over the busiest rank's busy time, tile density over all ranks'
        expert GEMMs), the recovery figures (`ElasticRecovery`: live while one is under way;
        a rank started again that became ready meanwhile is taken in first) and the
        rebalancer's. A rank still joining, or retired for good, has no row in ``ranks``."""
        while True:
            self._check_open()
            token = next(self._answer_token)
            self.rank_set.broadcast(msg.GetMetrics(token))
            # not ranks started again and still loading, nor retired ones (`broadcast` skips
            # them)
            keys = [(token, r.rank) for r in self._running_ranks()]
            try:
                while any(k not in self._answers for k in keys):
                    self._dispatch(self.rank_set.receive(1.0))
            except RankFailedError as failure:
                self._recover(failure)
                continue
            ranks = [self._answers.pop(k) for k in keys]
            totals = aggregate_metrics(ranks, time.perf_counter() - self._started)
            totals["rank_busy_seconds"] = [r["busy_seconds"] for r in ranks]
            return {**totals, **self._recovery_metrics(), **self.rebalancer.metrics.as_dict()}

    def _running_ranks(self) -> list:
        """The ranks that run: not started again and still joining, not retired for good."""
        return [r for r in self._ranks if not r.joining and not r.retired]

    def _recovery_metrics(self) -> dict:
        self._check_recovered()
        return self.recovery.metrics([r.rank for r in self._ranks if r.joining])

    def _poll(self) -> None:
        """Take what the ranks sent meanwhile (heartbeats, outputs for the next `step`, a rank
        started again connecting or ready) without waiting; a failure is left for `step` to
        raise."""
        if self.rank_set.failure is None and not self.rank_set.closed:
            try:
                self._dispatch(self.rank_set.receive(0))
            except RankFailedError:
                pass

    @property
    @locked
    def stats(self):
        """`EngineStats` summed over the ranks' last heartbeats (at most a second old; a rank
        retired for good keeps its last figures: its work was done)."""
        from batchgen.engine.llm_engine import EngineStats

        self._poll()

        def total(key: str) -> int:
            return sum(r.counters.get(key, 0) for r in self._ranks)

        return EngineStats(
            num_prompt_tokens=total("num_prompt_tokens"),
            num_generated_tokens=total("num_generated_tokens"),
            num_preemptions=total("num_preemptions"),
            prefix_cache_queries=total("prefix_cache_queries"),
            prefix_cache_hits=total("prefix_cache_hits"),
            prefix_cache_evictions=total("prefix_cache_evictions"),
        )

    @property
    @locked
    def kv_cache(self) -> _KVUsage:
        """``.usage``: the mean KV cache use over the running ranks (last heartbeats)."""
        self._poll()
        usages = [r.counters.get("kv_cache_usage", 0.0) for r in self._running_ranks()]
        return _KVUsage(sum(usages) / len(usages) if usages else 0.0)

    @locked
    def live_metrics(self) -> dict:
        """Figures from the ranks' last heartbeats, without a round trip (the service reads
        these every second): ``tile_density`` over all ranks, ``num_running``,
        ``num_waiting``, and the recovery figures (`ElasticRecovery`)."""
        self._poll()
        rows = sum(r.counters.get("expert_rows", 0) for r in self._ranks)
        tile_rows = sum(r.counters.get("expert_tile_rows", 0) for r in self._ranks)
        running = self._running_ranks()
        return {
            "tile_density": rows / tile_rows if tile_rows else None,
            "num_running": sum(r.counters.get("num_running", 0) for r in running),
            "num_waiting": sum(r.counters.get("num_waiting", 0) for r in running),
            **self._recovery_metrics(),
        }

    def get_partial_texts(self, request_id: str) -> None:
        """Streaming text is not relayed from the ranks yet: None (a streamed response then
        carries the whole text in its last chunk)."""
        return None

    @locked
    def reset_metrics(self) -> None:
        self.rank_set.broadcast(msg.ResetMetrics())
        self._started = time.perf_counter()
        self.rebalancer.reset_metrics()
