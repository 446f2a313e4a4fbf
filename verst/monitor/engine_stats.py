"""The engines' metrics in the run's metrics: every step the trainer samples each engine's
Prometheus metrics (`verst.engine.metrics`) into `engine/*` keys.

Owns `EngineSampler`. The embedded engine's scheduler is read in-process (its collector, no
HTTP); a fleet's engines through `EngineClient.metric_families` (in-process engines read their
registry, engine processes and SGLang servers answer `GET /metrics`). Gauges are the state at
the end of the step, summed over engines (KV usage: the fullest engine; weight version: the
oldest); counters and histograms become this step's increase, and rates over the wall time
since the last sample. An engine restarted meanwhile starts its counters from zero again, as
Prometheus' `increase` reads a reset. An engine that does not answer is left out of that step
(`engine/sampled_engines` says how many answered); the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from verst.engine.metrics import SchedulerCollector
from verst.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from verst.fleet.fleet import Fleet

log = logging.getLogger(__name__)

Values = dict[str, float]  # sample name -> value, summed over label sets

GAUGE_SUMS = {
    "num_running_reqs": "sglang:num_running_reqs",
    "num_queue_reqs": "sglang:num_queue_reqs",
    "num_used_tokens": "sglang:num_used_tokens",
    "max_total_num_tokens": "sglang:max_total_num_tokens",
    "gen_throughput": "sglang:gen_throughput",
}
COUNTERS = {  # engine/<key>: the step's increase of the counter
    "prompt_tokens": "sglang:prompt_tokens_total",
    "generation_tokens": "sglang:generation_tokens_total",
    "cached_tokens": "sglang:cached_tokens_total",
    "requests": "sglang:num_requests_total",
    "aborted_requests": "sglang:num_aborted_requests_total",
    "retractions": "verst:retractions_total",
    "scheduler_requests": "verst:scheduler_requests_total",
}
MEANS = {  # engine/<key>: the step's mean, from a histogram's _sum and _count
    "ttft_mean_s": "sglang:time_to_first_token_seconds",
    "e2e_latency_mean_s": "sglang:e2e_request_latency_seconds",
    "inter_token_latency_mean_s": "verst:request_inter_token_latency_seconds",
}
RATIOS = {  # engine/<key>: increase of one counter over another's
    "cache_hit_rate": (
        "verst:prefix_cache_hit_tokens_total",
        "verst:prefix_cache_query_tokens_total",
    ),
    "cached_prompt_fraction": ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
}


def sample_values(families: list[Metric]) -> Values:
    """One engine's samples by name, summed over their label sets."""
    values: Values = {}
    for family in families:
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


class EngineSampler:
    """`sample()` once a step: the `engine/*` metrics since the last call. `read` returns each
    engine's metric families by a name that stays the same across steps (its URL)."""

    def __init__(self, read: Callable[[], dict[str, list[Metric] | BaseException]]) -> None:
        self.read = read
        self._last: dict[str, Values] = {}
        self._last_s = time.perf_counter()
        self._warned = False

    @classmethod
    def for_engine(cls, engine: Any, fleet: Fleet | None) -> EngineSampler:
        """The sampler for a run's engine: the embedded scheduler or rank 0's fleet (nothing on
        the other ranks of a fleet: rank 0 logs)."""
        if isinstance(engine, Scheduler):
            collector = SchedulerCollector(engine, model_name=lambda: "embedded")
            return cls(lambda: {"embedded": list(collector.collect())})
        if fleet is not None:
            return cls(lambda: _read_fleet(fleet))
        return cls(dict)

    def sample(self) -> dict[str, float]:
        now_s = time.perf_counter()
        answers = self.read()
        if not answers:
            return {}
        engines = {k: sample_values(v) for k, v in answers.items() if isinstance(v, list)}
        failed = {k: v for k, v in answers.items() if not isinstance(v, list)}
        if failed and not self._warned:
            self._warned = True
            log.warning("engine metrics: no answer from %s (warned once)", failed)
        wall_s = max(now_s - self._last_s, 1e-9)
        increase = {name: 0.0 for name in _counter_names()}
        for key, values in engines.items():
            last = self._last.get(key, {})
            for name in increase:
                now, before = values.get(name), last.get(name, 0.0)
                if now is not None:
                    increase[name] += now - before if now >= before else now  # a reset
        self._last |= engines
        self._last_s = now_s
        present = {n for values in engines.values() for n in values}
        return _step_metrics(engines, increase, present, wall_s)


def _counter_names() -> set[str]:
    names = set(COUNTERS.values()) | {n for pair in RATIOS.values() for n in pair}
    names |= {f"{h}_{part}" for h in MEANS.values() for part in ("sum", "count")}
    return names | {"verst:scheduler_busy_seconds_total"}


def _step_metrics(
    engines: dict[str, Values], increase: Values, present: set[str], wall_s: float
) -> dict[str, float]:
    out = {"engine/sampled_engines": float(len(engines))}
    for key, name in GAUGE_SUMS.items():
        if name in present:
            out[f"engine/{key}"] = sum(v.get(name, 0.0) for v in engines.values())
    usage = [v["sglang:token_usage"] for v in engines.values() if "sglang:token_usage" in v]
    if usage:
        out["engine/token_usage"] = max(usage)
    versions = [v["verst:weight_version"] for v in engines.values() if "verst:weight_version" in v]
    if versions:
        out["engine/weight_version"] = min(versions)
    for key, name in COUNTERS.items():
        if name in present:
            out[f"engine/{key}"] = increase[name]
    if "sglang:generation_tokens_total" in present:
        out["engine/generation_tokens_per_s"] = increase["sglang:generation_tokens_total"] / wall_s
    busy = "verst:scheduler_busy_seconds_total"
    if busy in present and engines:
        out["engine/busy_fraction"] = increase[busy] / (wall_s * len(engines))
    for key, name in MEANS.items():
        count = increase[f"{name}_count"]
        if count > 0:
            out[f"engine/{key}"] = increase[f"{name}_sum"] / count
    for key, (part, whole) in RATIOS.items():
        if increase[whole] > 0:
            out[f"engine/{key}"] = increase[part] / increase[whole]
    return out


def _read_fleet(fleet: Fleet) -> dict[str, list[Metric] | BaseException]:
    engines = fleet.serving_engines()

    async def read_all() -> list[list[Metric] | BaseException]:
        calls = (client.metric_families() for client in engines.values())
        return await asyncio.gather(*calls, return_exceptions=True)

    return dict(zip(engines, fleet.wait(read_all()), strict=True))
