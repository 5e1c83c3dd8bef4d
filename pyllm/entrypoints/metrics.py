"""Prometheus metrics for `GET /metrics`.

Engine state (requests running and waiting, KV blocks, token and preemption counts,
prefix-cache hits) is read when the metrics are scraped, from one snapshot of the
engine's own counters (LLMEngine.stats), so it can never drift from what the engine
did. Per-request latencies (time to first token, time per output token, end to end)
are observed by the server as each request finishes. Each app gets its own registry,
so several can live in one process.

Taking the snapshot from the event loop while the engine thread steps is safe: each of
its reads is one int or one len() of a container, atomic under the GIL.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pyllm.engine.async_engine import AsyncEngine
from pyllm.engine.stats import EngineStats

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        stats = self.engine.stats()
        yield from self._request_gauges(stats)
        yield from self._kv_gauges(stats)
        yield from self._counters(stats)

    def _request_gauges(self, stats: EngineStats):
        yield self._gauge(
            "pyllm:num_requests_running", "Sequences in the running batch", stats.num_running
        )
        yield self._gauge(
            "pyllm:num_requests_waiting",
            "Sequences waiting for their first schedule (or to be recomputed), and "
            "requests not yet taken by the engine",
            stats.num_waiting + self.engine.num_pending,
        )

    def _kv_gauges(self, stats: EngineStats):
        yield self._gauge(
            "pyllm:kv_cache_usage_perc",
            "Share of the KV cache in use (0 to 1): blocks held (paged) or budget committed "
            "(contiguous)",
            stats.kv_cache_usage,
        )
        yield self._gauge(
            "pyllm:kv_cache_committed_bytes",
            "Physical KV cache memory held: all of it when paged, what the arena has mapped "
            "when contiguous",
            stats.kv_cache_committed_bytes,
        )
        if stats.num_kv_blocks is not None:  # a layout made of blocks
            yield self._gauge(
                "pyllm:num_free_kv_blocks",
                "KV blocks free to allocate (cached prefixes nobody holds count as free)",
                stats.num_free_kv_blocks,
            )
            yield self._gauge("pyllm:num_kv_blocks", "KV blocks in the cache", stats.num_kv_blocks)

    def _counters(self, stats: EngineStats):
        yield self._counter("pyllm:generation_tokens", "Tokens generated", stats.generation_tokens)
        yield self._counter(
            "pyllm:prompt_tokens_computed",
            "Prompt tokens run through the model (prefix-cache hits excluded, "
            "recomputation after preemption included)",
            stats.prompt_tokens_computed,
        )
        yield self._counter("pyllm:num_preemptions", "Sequences preempted", stats.num_preemptions)
        yield self._counter(
            "pyllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            stats.prefix_cache_queries,
        )
        yield self._counter(
            "pyllm:prefix_cache_hits",
            "Prompt tokens served from the prefix cache",
            stats.prefix_cache_hits,
        )
        yield from self._prefix_cache_disk_counters(stats)
        yield self._counter("pyllm:engine_steps", "Engine steps run", stats.steps)
        yield from self._spec_decode_counters(stats)

    def _prefix_cache_disk_counters(self, stats: EngineStats):
        for name, doc in (
            ("hits", "Prompt tokens read from the prefix cache on disk (prefix_cache_dir)"),
            ("writes", "KV blocks written to the prefix cache on disk"),
            ("damaged", "Prefix-cache files refused as damaged and recomputed"),
        ):
            value = getattr(stats, f"prefix_cache_disk_{name}")
            yield self._counter(f"pyllm:prefix_cache_disk_{name}", doc, value)

    def _spec_decode_counters(self, stats: EngineStats):
        for name, doc in (
            ("drafts", "Drafts of proposed tokens verified (speculative decoding)"),
            ("draft_tokens", "Tokens proposed and verified (speculative decoding)"),
            ("accepted_tokens", "Proposed tokens accepted (speculative decoding)"),
            ("emitted_tokens", "Tokens emitted by sequences verifying a draft, accepted ones "
             "and the one after them (speculative decoding)"),
        ):  # fmt: skip
            value = getattr(stats, f"spec_decode_num_{name}")
            yield self._counter(f"pyllm:spec_decode_num_{name}", doc, value)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.prompt_tokens = Counter(
            "pyllm:prompt_tokens", "Prompt tokens of accepted requests", labels,
            registry=self.registry,
        ).labels(model_name)  # fmt: skip
        self.requests = Counter(
            "pyllm:request_success",
            "Requests finished, by finish reason",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.time_to_first_token = histogram(
            "pyllm:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            _TTFT_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "pyllm:time_per_output_token_seconds",
            "Seconds per output token after the first, averaged over each request",
            _TPOT_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "pyllm:e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token",
            _E2E_BUCKETS,
        )

    def observe_finished(
        self,
        arrival_time: float,
        first_token_time: float | None,
        finish_time: float,
        num_output_tokens: int,
        finish_reasons: list[str],
    ) -> None:
        """One finished request: times are time.time() values, tokens over all choices."""
        self.e2e_request_latency.observe(max(0.0, finish_time - arrival_time))
        if first_token_time:
            self.time_to_first_token.observe(max(0.0, first_token_time - arrival_time))
            if num_output_tokens > 1:
                per_token = (finish_time - first_token_time) / (num_output_tokens - 1)
                self.time_per_output_token.observe(max(0.0, per_token))
        for reason in finish_reasons:
            self.requests.labels(self.model_name, reason or "none").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
