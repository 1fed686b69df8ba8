"""Prometheus metrics of a serving engine (exposed by the server at GET /metrics).

Latency histograms are observed per request as its tokens are delivered; gauges and running
totals (requests, KV usage, prefix cache, preemptions, recompilations, token counts) are read
from the engine at scrape time, so they cannot drift from the engine's own counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pypto_serving.engine.core import EngineStats

PREFIX = "pypto_"

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        gauges = {
            "num_requests_running": ("Requests being computed", s.num_running),
            "num_requests_waiting": ("Requests queued (new or preempted)", s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV pages held by requests (0-1)", s.kv_usage),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        counters = {
            "prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache",
                s.prefix_queries,
            ),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache", s.prefix_hits),
            "num_preemptions": ("Requests preempted", s.num_preemptions),
            "recompilations": ("torch.compile recompilations after warm-up", s.num_recompilations),
            "prompt_tokens": ("Prompt tokens computed (cache hits excluded)", s.prompt_tokens),
            "generation_tokens": ("Tokens generated", s.generation_tokens),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c


class EngineMetrics:
    """The metric objects of one engine, in their own registry (several engines may coexist)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))

        def histogram(name: str, doc: str) -> Histogram:
            h = Histogram(
                PREFIX + name,
                doc,
                ["model_name"],
                buckets=LATENCY_BUCKETS,
                registry=self.registry,
            )
            return h.labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first output token")
        self.itl = histogram("inter_token_latency_seconds", "Gap between successive tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled")
        self._finished = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name

    def finished(self, reason: str, num_sequences: int) -> None:
        self._finished.labels(self.model_name, reason).inc(num_sequences)
