"""Prometheus metrics of a serving engine (exposed by the server at GET /metrics).

Latency histograms are observed per request as its tokens are delivered; gauges and running
totals (requests, KV usage, prefix cache, preemptions, recompilations, token counts) are read
from the engine at scrape time, so they cannot drift from the engine's own counters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pypto_serving.engine.core import EngineStats
from pypto_serving.kv.tier import LOAD_BUCKETS, TierStats

PREFIX = "pypto_"

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        gauges = {
            "num_requests_running": ("Requests being computed", s.num_running),
            "num_requests_waiting": ("Requests queued (new or preempted)", s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV pages held by requests (0-1)", s.kv_usage),
            "compiling": (
                "1 while warm-up compiles in the background (steps partly eager), else 0",
                int(s.compiling),
            ),
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
            "num_preemptions_swapped": (
                "Preemptions whose KV was swapped to the CPU tier (the rest recompute)",
                s.num_swapped,
            ),
            "recompilations": ("torch.compile recompilations after warm-up", s.num_recompilations),
            "prompt_tokens": ("Prompt tokens computed (cache hits excluded)", s.prompt_tokens),
            "generation_tokens": ("Tokens generated", s.generation_tokens),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        if s.tiers:
            yield from self._tiers(s.tiers)

    def _tiers(self, tiers: tuple[TierStats, ...]) -> Iterator[Metric]:
        """Per KV tier (label tier = device, cpu, ssd): occupancy, lookups, pages moved."""
        labels = ["model_name", "tier"]
        gauges = {
            "kv_tier_capacity_pages": (
                "Pages the tier's budget holds (remote: what this server lends the pool)",
                lambda t: t.capacity,
            ),
            "kv_tier_used_pages": (
                "Pages held now (device: by requests; cpu: cached or swapped; ssd: cached; "
                "remote: known in the shared pool, from any member)",
                lambda t: t.used,
            ),
            "kv_tier_usage_perc": (
                "Fraction of the tier's pages in use (0-1; none for the shared remote pool)",
                lambda t: t.usage,
            ),
        }
        for name, (doc, get) in gauges.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for t in tiers:
                if (value := get(t)) is not None:
                    g.add_metric([self.model_name, t.name], value)
            yield g
        counters = {
            "kv_tier_hits": ("Prompt pages found in the tier at admission", "hits", 1),
            "kv_tier_misses": ("Prompt pages looked up in the tier, not found", "misses", 1),
            "kv_tier_stored_pages": ("Pages written into the tier", "stored", 1),
            "kv_tier_loaded_pages": ("Pages loaded from the tier into the device", "loaded", 1),
            "kv_tier_evicted_pages": ("Cached pages pushed out for room", "evicted", 1),
            "kv_tier_stored_bytes": ("Bytes written into the tier", "stored", 0),
            "kv_tier_loaded_bytes": ("Bytes loaded from the tier into the device", "loaded", 0),
            "kv_tier_evicted_bytes": ("Bytes of cached pages pushed out for room", "evicted", 0),
            "kv_tier_errors": ("I/O errors of the tier (each costs a page)", "errors", 1),
            "kv_tier_rejected_pages": (
                "Pages found damaged, foreign or forged in the tier (recomputed)",
                "rejected",
                1,
            ),
        }
        for name, (doc, attr, pages) in counters.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for t in tiers:
                value = getattr(t, attr) * (1 if pages else t.page_bytes)
                c.add_metric([self.model_name, t.name], value)
            yield c
        h = HistogramMetricFamily(
            PREFIX + "kv_tier_load_seconds",
            "Time to load one request's pages from the tier into the device",
            labels=labels,
        )
        bounds = [str(b) for b in LOAD_BUCKETS] + ["+Inf"]
        for t in tiers:
            if t.name == "device":
                continue
            cumulative = list(itertools.accumulate(t.load_buckets))
            h.add_metric(
                [self.model_name, t.name],
                list(zip(bounds, cumulative, strict=True)),
                t.load_seconds_sum,
            )
        yield h


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
