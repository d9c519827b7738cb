"""The engine's run metrics as `LLMEngine` reports them (`get_metrics`, `reset_metrics`): the
step metrics of `batchgen.engine.metrics` with the scheduler's, the coalescer's, the prefix
cache's and the expert-parallel rank's counters added. A mixin of `LLMEngine` (split from
llm_engine.py)."""

from __future__ import annotations

from batchgen.models.layers.moe import SparseMoeBlock

_CACHE_COUNTERS = ("queries", "hits", "evictions")  # `PrefixCacheStats` fields


class EngineMetricsView:
    """`LLMEngine`'s metrics methods (it supplies ``metrics``, ``scheduler``, ``executor``,
    ``runner``, ``kv_cache``, ``device``, ``config``, ``expert_parallel``,
    ``num_dummy_steps`` and ``_prefix_cache_base``)."""

    def get_metrics(self) -> dict:
        """Run metrics since start (or `reset_metrics`): tokens/s, expert GEMMs, tile density,
        stage time shares, peak memory, preemptions. See `batchgen.engine.metrics`."""
        snap = self.metrics.snapshot(self.device)
        snap["num_preemptions"] = self.scheduler.num_preemptions
        snap["scheduler_policy"] = self.config.scheduler_policy
        snap["coalescer_holds"] = self.executor.coalescer.num_holds
        snap["routed_expert_bytes"] = self.runner.model.routed_expert_bytes()
        snap["dummy_steps"] = self.num_dummy_steps
        snap.update(self._prefix_cache_metrics())
        if self.expert_parallel is not None:
            snap.update(self.expert_parallel.metrics())
        return snap

    def _prefix_cache_metrics(self) -> dict:
        """``prefix_cache_queries`` / ``_hits`` (tokens) / ``_hit_rate`` / ``_evictions``
        (blocks) since start or `reset_metrics` (zeros with caching off)."""
        cache = self.kv_cache.prefix_cache
        now = vars(cache.stats) if cache is not None else {}
        delta = {k: now.get(k, 0) - self._prefix_cache_base.get(k, 0) for k in _CACHE_COUNTERS}
        queries = delta["queries"]
        return {
            "prefix_cache_enabled": cache is not None,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": delta["hits"],
            "prefix_cache_hit_rate": delta["hits"] / queries if queries else 0.0,
            "prefix_cache_evictions": delta["evictions"],
        }

    def reset_metrics(self) -> None:
        """Start the run metrics and the prefix-cache counters over (the bench calls it after
        its warm-up)."""
        self.metrics.reset()
        cache = self.kv_cache.prefix_cache
        self._prefix_cache_base = dict(vars(cache.stats)) if cache is not None else {}
        for module in self.runner.model.modules():
            if isinstance(module, SparseMoeBlock):
                module.stats = self.metrics.expert
