"""``GET /metrics``: Prometheus text format (`prometheus_client`), from a private registry.

Values are read at scrape time from the engine loop's `LoopStats` snapshot (replaced whole
after every engine step, so a scrape never sees half an update) and from the store's batch
counts. Metric names (all prefixed ``batchgen_``):

====================================  =====  ===================================================
name                                  type   meaning
====================================  =====  ===================================================
requests{source,state}                gauge  batch requests ``queued`` (stored, not yet in the
                                             engine) / ``running``; online ``running``
requests_finished_total{source,       count  requests finished since start, ``outcome``
outcome}                                     ``succeeded`` or ``failed``
batches{status}                       gauge  batches per OpenAI status
prompt_tokens_total                   count  prompt tokens prefilled
generation_tokens_total               count  tokens generated
generation_tokens_per_second          gauge  generated tokens/s over the last 10 s
queue_depth                           gauge  requests waiting for admission (batch + online)
active_coroutines                     gauge  sequences running in the engine
active_batches                        gauge  in-progress batches feeding the engine
kv_cache_usage_ratio                  gauge  share of KV cache blocks in use, [0, 1]
tile_density                          gauge  expert-GEMM tile density (DESIGN.md), [0, 1];
                                             NaN while the engine does not report it
prefix_cache_queries_total            count  prompt tokens looked up in the prefix cache
                                             (vLLM's ``vllm:prefix_cache_queries``)
prefix_cache_hits_total               count  of those, tokens found cached (their prefill
                                             skipped; ``vllm:prefix_cache_hits``)
prefix_cache_evictions_total          count  cached KV blocks evicted for new content
engine_up                             gauge  1 while the engine thread runs
====================================  =====  ===================================================

Plus the request-latency histograms of `batchgen.service.latency` (queue time, time to first
token, end to end; vLLM's names with ``batchgen_`` for ``vllm:``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchgen.service import store as st
from batchgen.service.engine_loop import LoopStats
from batchgen.service.latency import LatencyHistograms

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STATUSES = (
    st.VALIDATING,
    st.IN_PROGRESS,
    st.FINALIZING,
    st.COMPLETED,
    st.FAILED,
    st.CANCELLING,
    st.CANCELLED,
    st.EXPIRED,
)


class ServiceCollector(Collector):
    """Builds every ``batchgen_*`` metric at scrape time.

    Args:
        stats: returns the current `LoopStats`.
        batch_counts: returns ``{status: number of batches}``.
        engine_up: returns whether the engine thread is alive.
        latency: the engine loop's request-latency histograms, if any.
    """

    def __init__(
        self,
        stats: Callable[[], LoopStats],
        batch_counts: Callable[[], dict[str, int]],
        engine_up: Callable[[], bool],
        latency: LatencyHistograms | None = None,
    ) -> None:
        self._stats = stats
        self._batch_counts = batch_counts
        self._engine_up = engine_up
        self._latency = latency

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        requests = GaugeMetricFamily(
            "batchgen_requests", "Requests by source and state", labels=["source", "state"]
        )
        requests.add_metric(["batch", "queued"], s.batch_queued)
        requests.add_metric(["batch", "running"], s.batch_running)
        requests.add_metric(["online", "running"], s.online_running)
        yield requests
        finished = CounterMetricFamily(
            "batchgen_requests_finished",
            "Requests finished since start",
            labels=["source", "outcome"],
        )
        for source in ("batch", "online"):
            for outcome in ("succeeded", "failed"):
                finished.add_metric([source, outcome], s.finished.get((source, outcome), 0))
        yield finished
        batches = GaugeMetricFamily("batchgen_batches", "Batches by status", labels=["status"])
        counts = self._batch_counts()
        for status in _STATUSES:
            batches.add_metric([status], counts.get(status, 0))
        yield batches
        yield CounterMetricFamily(
            "batchgen_prompt_tokens", "Prompt tokens prefilled", value=s.prompt_tokens_total
        )
        yield CounterMetricFamily(
            "batchgen_generation_tokens", "Tokens generated", value=s.generated_tokens_total
        )
        yield GaugeMetricFamily(
            "batchgen_generation_tokens_per_second",
            "Generated tokens per second over the last 10 s",
            value=s.generated_tokens_per_s,
        )
        yield GaugeMetricFamily(
            "batchgen_queue_depth",
            "Requests waiting for admission to the engine",
            value=s.batch_queued + s.online_waiting,
        )
        yield GaugeMetricFamily(
            "batchgen_active_coroutines",
            "Sequences running in the engine",
            value=s.active_coroutines,
        )
        yield GaugeMetricFamily(
            "batchgen_active_batches", "In-progress batches", value=s.active_batches
        )
        yield GaugeMetricFamily(
            "batchgen_kv_cache_usage_ratio",
            "Share of KV cache blocks in use",
            value=s.kv_cache_usage,
        )
        density = math.nan if s.tile_density is None else float(s.tile_density)
        yield GaugeMetricFamily(
            "batchgen_tile_density", "Expert-GEMM tile density (NaN: not reported)", value=density
        )
        yield CounterMetricFamily(
            "batchgen_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=s.prefix_cache_queries_total,
        )
        yield CounterMetricFamily(
            "batchgen_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (prefill skipped)",
            value=s.prefix_cache_hits_total,
        )
        yield CounterMetricFamily(
            "batchgen_prefix_cache_evictions",
            "Cached KV blocks evicted for new content",
            value=s.prefix_cache_evictions_total,
        )
        yield GaugeMetricFamily(
            "batchgen_engine_up", "1 while the engine thread runs", value=int(self._engine_up())
        )
        if self._latency is not None:
            yield from self._latency.collect()


def make_registry(collector: ServiceCollector) -> CollectorRegistry:
    """A private registry (not prometheus_client's global one) holding ``collector``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)
