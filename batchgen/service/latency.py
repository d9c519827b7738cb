"""Per-request latency histograms for ``/metrics``, from each finished request's
`RequestMetrics` (vLLM's histograms, with ``batchgen_`` for ``vllm:``).

=======================================  ===================================================
name                                     seconds from the engine's arrival of a request to
=======================================  ===================================================
batchgen_request_queue_time_seconds      its first scheduled step (time waiting in the engine)
batchgen_time_to_first_token_seconds     its first generated token
batchgen_e2e_request_latency_seconds     its end (all samples finished)
=======================================  ===================================================

Each has the label ``source`` (``batch`` or ``online``). A batch request arrives in the engine
when the engine loop admits it, so its time waiting in the job store before that is not
counted (``batchgen_requests{state="queued"}`` shows that queue). Observed on the engine thread,
read at scrape time (prometheus_client's histograms are thread-safe).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import Metric

from batchgen.outputs import RequestOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class LatencyHistograms:
    """The three request-latency histograms, labelled by ``source``."""

    def __init__(self) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["source"], buckets=buckets, registry=None)

        self.queue_time = histogram(
            "batchgen_request_queue_time_seconds",
            "Seconds a request waited in the engine before its first step",
            _REQUEST_BUCKETS,
        )
        self.time_to_first_token = histogram(
            "batchgen_time_to_first_token_seconds",
            "Seconds from a request's arrival in the engine to its first token",
            _TTFT_BUCKETS,
        )
        self.e2e_latency = histogram(
            "batchgen_e2e_request_latency_seconds",
            "Seconds from a request's arrival in the engine to its end",
            _REQUEST_BUCKETS,
        )

    def observe(self, output: RequestOutput, source: str) -> None:
        """Record a finished request (``source``: ``batch`` or ``online``); requests without
        timestamps (failed before they ran) are skipped."""
        m = output.metrics
        if m is None or m.finished_time is None:
            return
        if m.first_scheduled_time is not None:
            self.queue_time.labels(source).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.time_to_first_token.labels(source).observe(m.first_token_time - m.arrival_time)
        self.e2e_latency.labels(source).observe(m.finished_time - m.arrival_time)

    def collect(self) -> Iterator[Metric]:
        """The histograms' current values, for a `prometheus_client` collector."""
        for histogram in (self.queue_time, self.time_to_first_token, self.e2e_latency):
            yield from histogram.collect()
