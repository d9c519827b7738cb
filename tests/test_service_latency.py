"""The request-latency histograms of ``/metrics`` (`batchgen.service.latency`), from
`RequestMetrics` to Prometheus text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from batchgen.outputs import RequestMetrics, RequestOutput
from batchgen.service import metrics
from batchgen.service.engine_loop import LoopStats
from batchgen.service.latency import LatencyHistograms


def _output(arrival, scheduled, first_token, finished) -> RequestOutput:
    m = RequestMetrics(arrival, first_token, scheduled, first_token, scheduled - arrival, finished)
    return RequestOutput("r", "p", [1], finished=True, metrics=m)


def _scrape(latency: LatencyHistograms) -> dict:
    collector = metrics.ServiceCollector(LoopStats, dict, lambda: True, latency)
    text = metrics.render(metrics.make_registry(collector)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_latency_histograms_observe_queue_ttft_and_e2e_per_source():
    latency = LatencyHistograms()
    latency.observe(_output(100.0, 100.25, 101.0, 103.0), "batch")
    latency.observe(_output(200.0, 200.0, 200.5, 260.0), "batch")
    latency.observe(_output(300.0, 300.1, 300.2, 300.4), "online")
    latency.observe(RequestOutput("x", None, [], finished=True, error="bad"), "batch")  # skipped
    s = _scrape(latency)
    batch = (("source", "batch"),)
    online = (("source", "online"),)
    assert s[("batchgen_request_queue_time_seconds_count", batch)] == 2
    assert s[("batchgen_request_queue_time_seconds_sum", batch)] == 0.25
    assert s[("batchgen_time_to_first_token_seconds_sum", batch)] == 1.5
    assert s[("batchgen_e2e_request_latency_seconds_sum", batch)] == 63.0
    assert s[("batchgen_e2e_request_latency_seconds_count", online)] == 1
    assert abs(s[("batchgen_e2e_request_latency_seconds_sum", online)] - 0.4) < 1e-9
    # vLLM's buckets: 3 s falls in le=5.0 but not le=2.5; 60 s in le=60.0.
    le = lambda v: (("le", v), ("source", "batch"))  # noqa: E731
    assert s[("batchgen_e2e_request_latency_seconds_bucket", le("2.5"))] == 0
    assert s[("batchgen_e2e_request_latency_seconds_bucket", le("5.0"))] == 1
    assert s[("batchgen_e2e_request_latency_seconds_bucket", le("60.0"))] == 2
    assert s[("batchgen_time_to_first_token_seconds_bucket", le("0.5"))] == 1
    assert s[("batchgen_time_to_first_token_seconds_bucket", le("1.0"))] == 2
