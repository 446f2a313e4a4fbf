"""Prometheus metrics of one engine, on a registry of its own (several engines in one process do
not collide), as `verst serve` answers them on `GET /metrics`.

Owns `SchedulerCollector`, which reads a `Scheduler`'s state when scraped (queue lengths, KV
pages, prefix-cache counters, `SchedulerStats`), and `EngineMetrics`, that collector plus the
per-request histograms a `ServingEngine` observes once per finished request. Nothing here runs in
the scheduler's step: gauges and counters are read at scrape time, histograms are observed as
requests end.

Names: SGLang's (`sglang:...`) where SGLang has the metric with the same meaning, so dashboards
and scrapers built for SGLang read verst engines; `verst:...` for the rest. Every metric carries
SGLang's `model_name` label. The list is in docs/engine_protocol.md ("Metrics").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from verst.engine.requests import GenerateOutput
from verst.engine.scheduler import FINISH_ABORT, Scheduler

LABELS = ("model_name",)
# Finer than SGLang's defaults (which start at 0.1 s): a small model answers in milliseconds.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
ITL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


# Read from the scheduler when scraped: name -> help text (counters get Prometheus' `_total`).
GAUGES = {
    "sglang:num_running_reqs": "Requests in the running batch.",
    "sglang:num_queue_reqs": "Requests waiting to run (queued, or retracted to free KV).",
    "sglang:num_used_tokens": "KV-cache tokens held by requests (whole pages; evictable cache "
    "left out).",
    "sglang:max_total_num_tokens": "Tokens the KV cache holds in all.",
    "sglang:token_usage": "num_used_tokens / max_total_num_tokens.",
    "sglang:cache_hit_rate": "Prefix-cache hit rate since start (hit / looked-up tokens).",
    "sglang:gen_throughput": "Tokens/s sampled while stepping, over the last 5 s of stepping.",
    "verst:prefix_cache_tokens": "KV-cache tokens the prefix cache holds (in use or evictable).",
    "verst:weight_version": "The weight version served (when it is a number).",
}
COUNTERS = {
    "sglang:prompt_tokens": "Prompt tokens of the requests that left the scheduler.",
    "sglang:generation_tokens": "Tokens sampled.",
    "sglang:cached_tokens": "Prompt tokens whose KV came from the prefix cache or a group sibling.",
    "verst:prefix_cache_hit_tokens": "Tokens found in the prefix cache.",
    "verst:prefix_cache_query_tokens": "Tokens looked up in the prefix cache.",
    "verst:retractions": "Times a running request was sent back to the queue to free KV.",
    "verst:scheduler_steps": "Scheduler steps that ran a batch.",
    "verst:scheduler_busy_seconds": "Seconds spent in those steps.",
    "verst:scheduler_requests": "Requests that left the scheduler (finished or aborted).",
}


def weight_version_number(version: int | str) -> float | None:
    """The weight version as a gauge value; None for a version that is not a number (SGLang's
    `/update_weight_version` takes any string)."""
    try:
        return float(version)
    except (TypeError, ValueError):
        return None


class SchedulerCollector(Collector):
    """A `Scheduler`'s gauges and counters, read when collected. `queued` adds requests waiting
    in front of the scheduler (a `ServingEngine`'s queue); `weight_version` overrides the
    scheduler's own version (the served one)."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        model_name: Callable[[], str],
        queued: Callable[[], int] = lambda: 0,
        weight_version: Callable[[], int | str] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        self.queued = queued
        self.weight_version = weight_version or (lambda: scheduler.weight_version)

    def collect(self) -> Iterator[Metric]:
        label = [self.model_name()]
        for name, value in self.gauges().items():
            gauge = GaugeMetricFamily(name, GAUGES[name], labels=LABELS)
            gauge.add_metric(label, value)
            yield gauge
        for name, value in self.counters().items():
            counter = CounterMetricFamily(name, COUNTERS[name], labels=LABELS)
            counter.add_metric(label, value)
            yield counter

    def gauges(self) -> dict[str, float]:
        s, pool = self.scheduler, self.scheduler.pool
        cache = s.cache.stats() if s.cache is not None else {}
        # SGLang's usage leaves out cached KV that could be evicted for new requests
        used_pages = pool.num_pages - pool.num_free() - int(cache.get("evictable_pages", 0))
        hit, query = cache.get("hit_tokens", 0), cache.get("query_tokens", 0)
        values = {
            "sglang:num_running_reqs": len(s.running),
            "sglang:num_queue_reqs": len(s.waiting) + self.queued(),
            "sglang:num_used_tokens": used_pages * pool.page_size,
            "sglang:max_total_num_tokens": pool.num_pages * pool.page_size,
            "sglang:token_usage": used_pages / pool.num_pages,
            "sglang:cache_hit_rate": hit / query if query else 0.0,
            "sglang:gen_throughput": s.stats.gen_throughput,
            "verst:prefix_cache_tokens": cache.get("cached_pages", 0) * pool.page_size,
        }
        version = weight_version_number(self.weight_version())
        if version is not None:
            values["verst:weight_version"] = version
        return values

    def counters(self) -> dict[str, float]:
        s, stats = self.scheduler, self.scheduler.stats
        cache = s.cache.stats() if s.cache is not None else {}
        return {
            "sglang:prompt_tokens": stats.prompt_tokens,
            "sglang:generation_tokens": stats.generated_tokens,
            "sglang:cached_tokens": stats.cached_prompt_tokens,
            "verst:prefix_cache_hit_tokens": cache.get("hit_tokens", 0),
            "verst:prefix_cache_query_tokens": cache.get("query_tokens", 0),
            "verst:retractions": stats.retractions,
            "verst:scheduler_steps": stats.steps,
            "verst:scheduler_busy_seconds": stats.busy_s,
            "verst:scheduler_requests": stats.finished_requests,
        }


class EngineMetrics:
    """One serving engine's registry: the scheduler's metrics and the per-request ones."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        model_name: str,
        queued: Callable[[], int],
        weight_version: Callable[[], int | str],
    ) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)
        r.register(
            SchedulerCollector(
                scheduler,
                model_name=lambda: self._model_name,
                queued=queued,
                weight_version=weight_version,
            )
        )
        self._requests = Counter("sglang:num_requests", "Requests answered.", LABELS, registry=r)
        self._aborted = Counter(
            "sglang:num_aborted_requests", "Requests answered with an abort.", LABELS, registry=r
        )
        self._ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            LABELS,
            registry=r,
            buckets=TTFT_BUCKETS_S,
        )
        self._e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Time from arrival to the answer.",
            LABELS,
            registry=r,
            buckets=E2E_BUCKETS_S,
        )
        self._itl = Histogram(
            "verst:request_inter_token_latency_seconds",
            "Each request's mean time between two output tokens (requests of 2+ tokens).",
            LABELS,
            registry=r,
            buckets=ITL_BUCKETS_S,
        )
        self._model_name = ""
        self.model_name = model_name

    @property
    def model_name(self) -> str:
        """The `model_name` label; `verst serve` sets its served name before it serves."""
        return self._model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        parents = (self._requests, self._aborted, self._ttft, self._e2e, self._itl)
        if self._model_name and name != self._model_name:
            for parent in parents:
                parent.remove(self._model_name)  # renamed before serving: nothing is lost
        # children made now show zeros before the first request, as scrapers expect
        self.requests, self.aborted, self.ttft, self.e2e, self.itl = (
            parent.labels(name) for parent in parents
        )
        self._model_name = name

    def observe_finished(self, out: GenerateOutput, submitted_s: float, done_s: float) -> None:
        """A request the scheduler returned (finished, or aborted for want of KV pages)."""
        self.requests.inc()
        if out.finish_reason == FINISH_ABORT:
            self.aborted.inc()
        self.e2e.observe(done_s - submitted_s)
        first = out.first_token_s
        if first is not None:
            self.ttft.observe(max(first - submitted_s, 0.0))
            if out.completion_tokens > 1:
                self.itl.observe((done_s - first) / (out.completion_tokens - 1))

    def observe_aborted(self, submitted_s: float, done_s: float) -> None:
        """A request answered with an abort by the serving engine (`abort`, a pause)."""
        self.requests.inc()
        self.aborted.inc()
        self.e2e.observe(done_s - submitted_s)

    def families(self) -> list[Metric]:
        return list(self.registry.collect())

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (what `GET /metrics` answers)."""
        return generate_latest(self.registry)
