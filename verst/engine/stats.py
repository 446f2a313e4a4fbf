"""The scheduler's own counters: steps, tokens, requests, and its recent generation throughput.

Owns `SchedulerStats`, bumped once a step (`record_step`) and once per request leaving the
scheduler (`record_request`), never per token: the hot loop pays a few integer additions a step.
`verst.engine.metrics` turns these, with the KV pool's and the prefix cache's state, into
Prometheus metrics; the trainer reads the same numbers in-process (`verst.monitor.engine_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass

THROUGHPUT_WINDOW_S = 5.0  # `gen_throughput` is measured over windows of this much stepping


@dataclass
class SchedulerStats:
    """Totals since the scheduler started (they only grow: Prometheus counters)."""

    steps: int = 0
    busy_s: float = 0.0  # time spent inside `Scheduler.step` with a batch to run
    generated_tokens: int = 0  # tokens sampled (aborted requests' included)
    prompt_tokens: int = 0  # prompt tokens of the requests that left the scheduler
    cached_prompt_tokens: int = 0  # of those, the ones whose KV came from the prefix cache
    finished_requests: int = 0  # requests that left the scheduler (finished or aborted)
    retractions: int = 0  # of those, the times one was sent back to the queue to free KV
    gen_throughput: float = 0.0  # tokens/s while stepping: the last full window's rate
    _window_busy_s: float = 0.0
    _window_tokens: int = 0
    _full_windows: int = 0

    def record_step(self, duration_s: float, generated: int) -> None:
        """One step that ran a batch: `duration_s` long, sampling `generated` tokens.

        The throughput is over busy time, as SGLang's decode log reports it: an engine that
        idles while the trainer trains keeps the rate it generated at. Until a first window is
        full it is the rate so far."""
        self.steps += 1
        self.busy_s += duration_s
        self.generated_tokens += generated
        self._window_busy_s += duration_s
        self._window_tokens += generated
        full = self._window_busy_s >= THROUGHPUT_WINDOW_S
        if full or not self._full_windows:
            self.gen_throughput = self._window_tokens / max(self._window_busy_s, 1e-9)
        if full:
            self._window_busy_s, self._window_tokens = 0.0, 0
            self._full_windows += 1

    def record_request(self, prompt_tokens: int, cached_tokens: int, retractions: int) -> None:
        self.finished_requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_tokens
        self.retractions += retractions
