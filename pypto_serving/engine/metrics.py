"""Prometheus metrics of a serving engine (exposed by the server at GET /metrics).

Every family is exposed twice: under this project's `pypto_` names and under vLLM's V1 names
(`vllm:`, with vLLM's `model_name` and `engine` labels), so dashboards and alerts written for
vLLM (its example Grafana dashboard among them) read this server as they read vLLM. The two are
one measurement: each gauge and counter is read once per scrape and written under both names,
each histogram observation made once and recorded in both (`Twin`). vLLM's deprecated names
its dashboard still queries (`vllm:gpu_cache_usage_perc`, `vllm:time_per_output_token_seconds`)
are there too.

Latency and size histograms are observed per request as its tokens are delivered and when it
finishes; gauges and running totals (requests, KV usage, prefix cache, preemptions,
recompilations, token counts) are read from the engine at scrape time, so they cannot drift
from the engine's own counters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pypto_serving.config import EngineConfig
from pypto_serving.engine.core import EngineStats
from pypto_serving.engine.kv_transfer import READ_BUCKETS, TransferStats
from pypto_serving.kv.tier import LOAD_BUCKETS, TierStats
from pypto_serving.speculative import SpecDecodeStats

PREFIX = "pypto_"
VLLM = "vllm:"
ENGINE = "0"
"""vLLM's `engine` label: the engine's index (one engine here; its DP replicas are summed)."""

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip

GAUGES = {  # pypto name -> (vLLM's names, help); values: gauge_values
    "num_requests_running": (("num_requests_running",), "Requests being computed"),
    "num_requests_waiting": (("num_requests_waiting",), "Requests queued (new or preempted)"),
    "kv_cache_usage_perc": (
        ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
        "Fraction of KV pages held by requests (0-1)",
    ),
    "compiling": ((), "1 while warm-up compiles in the background (steps partly eager), else 0"),
}
COUNTERS = {  # pypto name -> (vLLM's names, help); values: counter_values
    "prefix_cache_queries": (
        ("prefix_cache_queries",),
        "Prompt tokens looked up in the prefix cache",
    ),
    "prefix_cache_hits": (("prefix_cache_hits",), "Prompt tokens found in the prefix cache"),
    "num_preemptions": (("num_preemptions",), "Requests preempted"),
    "num_preemptions_swapped": (
        (),
        "Preemptions whose KV was swapped to the CPU tier (the rest recompute)",
    ),
    "recompilations": ((), "torch.compile recompilations after warm-up"),
    "prompt_tokens": (("prompt_tokens",), "Prompt tokens computed (cache hits excluded)"),
    "generation_tokens": (("generation_tokens",), "Tokens generated"),
}


def gauge_values(s: EngineStats) -> dict[str, float]:
    return {
        "num_requests_running": s.num_running,
        "num_requests_waiting": s.num_waiting,
        "kv_cache_usage_perc": s.kv_usage,
        "compiling": int(s.compiling),
    }


def counter_values(s: EngineStats) -> dict[str, float]:
    return {
        "prefix_cache_queries": s.prefix_queries,
        "prefix_cache_hits": s.prefix_hits,
        "num_preemptions": s.num_preemptions,
        "num_preemptions_swapped": s.num_swapped,
        "recompilations": s.num_recompilations,
        "prompt_tokens": s.prompt_tokens,
        "generation_tokens": s.generation_tokens,
    }


def one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out: list[float] = []
    for exponent in itertools.count():
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(value)
    return tuple(out)


def cache_info(config: EngineConfig, stats: EngineStats) -> dict[str, str]:
    """vLLM's cache_config_info labels: the KV cache's configuration, as strings."""
    cache = config.cache
    device = next((t for t in stats.tiers if t.name == "device"), None)
    return {
        "block_size": str(cache.page_size),
        "cache_dtype": str(cache.kv_cache_dtype),
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        "num_gpu_blocks": str(device.capacity if device is not None else cache.num_kv_pages),
        "cpu_offload_bytes": str(cache.kv_cpu_bytes),
    }


class Twin:
    """One histogram under several names (ours and vLLM's): each observation in all."""

    def __init__(self, children: Sequence[Histogram]) -> None:
        self.children = children

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class _EngineCollector(Collector):
    def __init__(
        self, stats: Callable[[], EngineStats], model_name: str, info: dict[str, str]
    ) -> None:
        self.stats, self.model_name, self.info = stats, model_name, info

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        ours, theirs = ["model_name"], ["model_name", "engine"]
        for kind, table, values in (
            (GaugeMetricFamily, GAUGES, gauge_values(s)),
            (CounterMetricFamily, COUNTERS, counter_values(s)),
        ):
            for name, (vllm_names, doc) in table.items():
                m = kind(PREFIX + name, doc, labels=ours)
                m.add_metric([self.model_name], values[name])
                yield m
                for vllm_name in vllm_names:
                    m = kind(VLLM + vllm_name, doc, labels=theirs)
                    m.add_metric([self.model_name, ENGINE], values[name])
                    yield m
        info = GaugeMetricFamily(
            VLLM + "cache_config_info", "The KV cache's configuration (vLLM's)", labels=[*self.info]
        )
        info.add_metric(list(self.info.values()), 1)
        yield info
        if s.tiers:
            yield from self._tiers(s.tiers)
        if s.spec_decode is not None:
            yield from self._spec_decode(s.spec_decode)

    def _spec_decode(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """Speculative decoding's counters, under vLLM's names too (their `position` label:
        a step's i-th draft token)."""
        values = {
            "spec_decode_num_drafts": ("Request steps that verified drafts", spec.num_drafts),
            "spec_decode_num_draft_tokens": ("Draft tokens verified", spec.num_draft_tokens),
            "spec_decode_num_accepted_tokens": ("Draft tokens kept", spec.num_accepted_tokens),
        }
        for name, (doc, value) in values.items():
            for metric, labels, extra in (
                (PREFIX + name, ["model_name"], []),
                (VLLM + name, ["model_name", "engine"], [ENGINE]),
            ):
                c = CounterMetricFamily(metric, doc, labels=labels)
                c.add_metric([self.model_name, *extra], value)
                yield c
        doc = "Draft tokens kept, by their position in the step's drafts"
        for metric, labels, extra in (
            (PREFIX + "spec_decode_num_accepted_tokens_per_pos", ["model_name", "position"], []),
            (
                VLLM + "spec_decode_num_accepted_tokens_per_pos",
                ["model_name", "engine", "position"],
                [ENGINE],
            ),
        ):
            c = CounterMetricFamily(metric, doc, labels=labels)
            for position, value in enumerate(spec.accepted_per_position):
                c.add_metric([self.model_name, *extra, str(position)], value)
            yield c

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


class TransferCollector(Collector):
    """Disaggregated serving's handoffs (`engine.kv_transfer.TransferStats`): what a prefill
    server offered, what a decode server read and how long the reads took."""

    def __init__(self, stats: Callable[[], TransferStats], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        s, name = self.stats(), [self.model_name]
        for metric, doc, value in (
            ("kv_transfer_offers", "Handoffs offered (a prefill server's)", s.offered),
            ("kv_transfer_offered_bytes", "Bytes of KV pages offered", s.offered_bytes),
            ("kv_transfer_pulled_pages", "KV pages read from prefill servers", s.pulled_pages),
            ("kv_transfer_pulled_bytes", "Bytes of KV pages read", s.pulled_bytes),
            (
                "kv_transfer_no_room",
                "Handoffs read before their device pages could be reserved (the pool was full)",
                s.no_room,
            ),
        ):
            c = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            c.add_metric(name, value)
            yield c
        pulls = CounterMetricFamily(
            PREFIX + "kv_transfer_pulls",
            "Handoffs a decode server read (ok) or could not take and computed (failed)",
            labels=["model_name", "outcome"],
        )
        pulls.add_metric([self.model_name, "ok"], s.pulled)
        pulls.add_metric([self.model_name, "failed"], s.failed)
        yield pulls
        h = HistogramMetricFamily(
            PREFIX + "kv_transfer_read_seconds",
            "Time of one handoff's read over the Transfer Engine",
            labels=["model_name"],
        )
        bounds = [str(b) for b in READ_BUCKETS] + ["+Inf"]
        cumulative = list(itertools.accumulate(s.read_buckets))
        h.add_metric(name, list(zip(bounds, cumulative, strict=True)), s.read_seconds)
        yield h


HISTOGRAMS = {  # pypto name -> (vLLM's names, help, buckets: "latency" or "tokens")
    "time_to_first_token_seconds": (
        ("time_to_first_token_seconds",),
        "Arrival to first output token",
        "latency",
    ),
    "inter_token_latency_seconds": (
        ("inter_token_latency_seconds", "time_per_output_token_seconds"),
        "Gap between successive tokens",
        "latency",
    ),
    "e2e_request_latency_seconds": (
        ("e2e_request_latency_seconds",),
        "Arrival to the last token",
        "latency",
    ),
    "request_queue_time_seconds": (
        ("request_queue_time_seconds",),
        "Arrival to first scheduled",
        "latency",
    ),
    "request_prefill_time_seconds": (
        ("request_prefill_time_seconds",),
        "First scheduled to first output token",
        "latency",
    ),
    "request_decode_time_seconds": (
        ("request_decode_time_seconds",),
        "First output token to the last",
        "latency",
    ),
    "request_inference_time_seconds": (
        ("request_inference_time_seconds",),
        "First scheduled to the last token",
        "latency",
    ),
    "request_time_per_output_token_seconds": (
        ("request_time_per_output_token_seconds",),
        "A request's decode time over its output tokens after the first",
        "latency",
    ),
    "request_prompt_tokens": (("request_prompt_tokens",), "Prompt tokens of a request", "tokens"),
    "request_generation_tokens": (
        ("request_generation_tokens",),
        "Tokens a request generated (all its sequences)",
        "tokens",
    ),
    "request_max_num_generation_tokens": (
        ("request_max_num_generation_tokens",),
        "Tokens of a request's longest sequence",
        "tokens",
    ),
    "request_params_n": (("request_params_n",), "A request's n", "n"),
    "request_params_max_tokens": (
        ("request_params_max_tokens",),
        "A request's max_tokens (or what its context left)",
        "tokens",
    ),
    "iteration_tokens_total": (
        ("iteration_tokens_total",),
        "Tokens computed in an engine step (prompt and generated)",
        "step",
    ),
}


class EngineMetrics:
    """The metric objects of one engine, in their own registry (several engines may coexist):
    each family under this project's name and vLLM's (`Twin`)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_name: str,
        max_model_len: int = 1 << 20,
        max_step_tokens: int = 1 << 16,
        info: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name, info or {}))
        buckets = {
            "latency": LATENCY_BUCKETS,
            "tokens": one_two_five(max_model_len),
            "n": (1, 2, 5, 10, 20),
            "step": one_two_five(max_step_tokens),
        }
        self.histograms: dict[str, Twin] = {}
        for name, (vllm_names, doc, kind) in HISTOGRAMS.items():
            made = [
                Histogram(
                    PREFIX + name,
                    doc,
                    ["model_name"],
                    buckets=buckets[kind],
                    registry=self.registry,
                ).labels(model_name)
            ]
            made += [
                Histogram(
                    VLLM + v,
                    doc,
                    ["model_name", "engine"],
                    buckets=buckets[kind],
                    registry=self.registry,
                ).labels(model_name, ENGINE)
                for v in vllm_names
            ]
            self.histograms[name] = Twin(made)
        self.ttft = self.histograms["time_to_first_token_seconds"]
        self.itl = self.histograms["inter_token_latency_seconds"]
        self.e2e = self.histograms["e2e_request_latency_seconds"]
        self.queue = self.histograms["request_queue_time_seconds"]
        self.iteration_tokens = self.histograms["iteration_tokens_total"]
        self._finished = [
            Counter(
                prefix + "request_success",
                "Finished requests by finish reason",
                labels,
                registry=self.registry,
            )
            for prefix, labels in (
                (PREFIX, ["model_name", "finished_reason"]),
                (VLLM, ["model_name", "engine", "finished_reason"]),
            )
        ]
        self.model_name = model_name

    def finished(self, reason: str, num_sequences: int) -> None:
        ours, theirs = self._finished
        ours.labels(self.model_name, reason).inc(num_sequences)
        theirs.labels(self.model_name, ENGINE, reason).inc(num_sequences)

    def request_done(self, done: FinishedRequest) -> None:
        """A finished request's sizes and phases (vLLM's per-request histograms)."""
        h = self.histograms
        h["request_prompt_tokens"].observe(done.prompt_tokens)
        h["request_generation_tokens"].observe(sum(done.output_tokens))
        h["request_max_num_generation_tokens"].observe(max(done.output_tokens, default=0))
        h["request_params_n"].observe(len(done.output_tokens))
        h["request_params_max_tokens"].observe(done.max_tokens)
        if done.scheduled is None or done.first_token is None:
            return  # never scheduled, or no token: no phases to time
        h["request_prefill_time_seconds"].observe(max(done.first_token - done.scheduled, 0.0))
        decode = max(done.last_token - done.first_token, 0.0)
        h["request_decode_time_seconds"].observe(decode)
        h["request_inference_time_seconds"].observe(max(done.last_token - done.scheduled, 0.0))
        longest = max(done.output_tokens, default=0)
        if longest > 1:
            h["request_time_per_output_token_seconds"].observe(decode / (longest - 1))


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What the per-request histograms read of a finished request (monotonic seconds)."""

    prompt_tokens: int
    output_tokens: list[int]
    """Tokens of each of its sequences."""
    max_tokens: int
    scheduled: float | None
    first_token: float | None
    last_token: float
