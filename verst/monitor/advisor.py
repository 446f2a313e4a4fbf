"""The advisor: rules over the recent window of a run's metrics, each naming what limits or
spoils the run in one line and the config field to change.

Owns `Advisor` and its rules. Each rule reads the metrics the loop logs (the window is the last
`monitor.advisor_window_steps` records, oldest first) and returns its advice or None; a rule
whose metrics are absent stays quiet. Every step the logger adds `advisor/<rule>` (1 when the
rule fires, else 0) for every rule; the console shows the advice (at most one line every
`monitor.advisor_interval_steps` steps) and `verst dashboard` replays the same rules over
`metrics.jsonl`. The advisor reads metrics and changes nothing.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Window = list[dict[str, Any]]  # the recent records, oldest first; the last is this step's

STALL_FACTOR = 6.0  # a step this many times the window's median step time is a stall
MIN_STALL_HISTORY = 3  # steps before the latest that a median needs
ABORT_RATIO = 0.05
ZERO_STD_RATIO = 0.5
TRUNCATED_RATIO = 0.25
KV_USAGE = 0.9
LOW_CONCURRENCY = 0.5  # running requests per engine below this share of max_batch_size
CACHE_HIT_RATE = 0.1
MFU = 0.15


@dataclass(frozen=True)
class RunFacts:
    """What the rules need to know of the run's config (defaults: `RunConfig`'s)."""

    mode: str = "sync"
    max_batch_size: int = 256

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RunFacts:
        """From the resolved config as `RunConfig.model_dump()` (or config.yaml) holds it."""
        placement = config.get("placement") or {}
        return cls(
            mode=str(config.get("mode", cls.mode)),
            max_batch_size=int(placement.get("max_batch_size", cls.max_batch_size)),
        )


@dataclass(frozen=True)
class Advice:
    rule: str  # the flag's name: advisor/<rule>
    step: int
    message: str  # what is wrong, and which field to change


def _number(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _mean(window: Window, key: str) -> float | None:
    values = [v for r in window if (v := _number(r, key)) is not None]
    return sum(values) / len(values) if values else None


def stall(window: Window, facts: RunFacts) -> str | None:
    history = [v for r in window[:-1] if (v := _number(r, "perf/step_time_s")) is not None]
    latest = _number(window[-1], "perf/step_time_s")
    if latest is None or len(history) < MIN_STALL_HISTORY:
        return None
    median = statistics.median(history)
    if median <= 0 or latest <= STALL_FACTOR * median:
        return None
    phases = {
        key[len("perf/") : -len("_time_s")]: v
        for key in window[-1]
        if key.startswith("perf/") and key.endswith("_time_s") and key != "perf/step_time_s"
        if (v := _number(window[-1], key)) is not None
    }
    slowest = max(phases, key=phases.__getitem__) if phases else "?"
    return (
        f"stall: this step took {latest:.3g} s, {latest / median:.1f}x the median {median:.3g} s "
        f"of the last {len(history)} (most in phase {slowest}); monitor.trace=true records "
        "where the time goes"
    )


def aborts(window: Window, facts: RunFacts) -> str | None:
    ratio = _mean(window, "rollout/aborted_ratio")
    agent = _mean(window, "rollout/agent_aborted_ratio")
    worst = max((r for r in (ratio, agent) if r is not None), default=None)
    if worst is None or worst <= ABORT_RATIO:
        return None
    return (
        f"aborts: {worst:.0%} of samples were aborted over the last {len(window)} steps "
        "(rollout/aborted_ratio), their tokens wasted; rollout.pause_mode=retract keeps "
        "requests across weight updates, and rollout.agent_timeout_s bounds agents"
    )


def zero_std(window: Window, facts: RunFacts) -> str | None:
    ratio = _mean(window, "rollout/zero_std_ratio")
    if ratio is None or ratio <= ZERO_STD_RATIO:
        return None
    return (
        f"zero-std groups: {ratio:.0%} of groups had equal rewards over the last {len(window)} "
        "steps and carry no GRPO signal; set rollout.dynamic_sampling=true (or raise "
        "rollout.n_samples_per_prompt)"
    )


def truncation(window: Window, facts: RunFacts) -> str | None:
    ratio = _mean(window, "rollout/truncated_ratio")
    if ratio is None or ratio <= TRUNCATED_RATIO:
        return None
    length = _mean(window, "rollout/response_len_mean")
    mean = f" (mean length {length:.3g} tokens)" if length is not None else ""
    return (
        f"truncation: {ratio:.0%} of responses hit the token limit over the last {len(window)} "
        f"steps{mean}; raise rollout.max_new_tokens"
    )


def kv_full(window: Window, facts: RunFacts) -> str | None:
    usage = _mean(window, "engine/token_usage")
    running = _mean(window, "engine/num_running_reqs")
    engines = _mean(window, "engine/sampled_engines") or 1.0
    if usage is None or running is None or usage <= KV_USAGE:
        return None
    per_engine = running / engines
    if per_engine >= LOW_CONCURRENCY * facts.max_batch_size:
        return None
    return (
        f"KV cache {usage:.0%} full with {per_engine:.3g} requests running an engine (of "
        f"placement.max_batch_size={facts.max_batch_size}): memory, not the batch size, limits "
        "concurrency; lower rollout.max_new_tokens or add engines (placement.num_engines)"
    )


def cache_hit(window: Window, facts: RunFacts) -> str | None:
    turns = _mean(window, "rollout/agent_turns_mean")
    hit = _mean(window, "engine/cache_hit_rate")
    if turns is None or turns <= 1 or hit is None or hit >= CACHE_HIT_RATE:
        return None
    return (
        f"prefix cache: {hit:.0%} of prompt tokens hit the cache in a multi-turn run "
        f"({turns:.3g} turns an episode); each turn should resend the conversation unchanged "
        "and reach the same engine (sessions route by key); placement.num_engines=1 tells "
        "which it is"
    )


def rollout_bound(window: Window, facts: RunFacts) -> str | None:
    if facts.mode != "fully_async" or _number(window[-1], "buffer/rollout_bound") != 1:
        return None
    return (
        "rollout-bound: the trainer waited for groups at every recent step (buffer/queue_size "
        "at 0); add generation capacity: placement.num_engines or rollout.max_inflight"
    )


def trainer_bound(window: Window, facts: RunFacts) -> str | None:
    if facts.mode != "fully_async" or _number(window[-1], "buffer/trainer_bound") != 1:
        return None
    return (
        "trainer-bound: the buffer was full at every recent step, so generation waits for the "
        "trainer; fewer engines (placement.num_engines) would do, and a smaller "
        "rollout.buffer_factor lowers staleness"
    )


def low_mfu(window: Window, facts: RunFacts) -> str | None:
    mfu = _mean(window, "perf/mfu")  # logged on CUDA only
    if mfu is None or mfu >= MFU:
        return None
    return (
        f"low MFU: training uses {mfu:.0%} of the GPU's peak FLOP/s over the last {len(window)} "
        "steps; larger micro-batches (trainer.micro_batch_tokens) or bf16 (trainer.dtype) "
        "keep it busier"
    )


RULES: dict[str, Callable[[Window, RunFacts], str | None]] = {
    "stall": stall,
    "aborts": aborts,
    "zero_std": zero_std,
    "truncation": truncation,
    "kv_full": kv_full,
    "cache_hit": cache_hit,
    "rollout_bound": rollout_bound,
    "trainer_bound": trainer_bound,
    "low_mfu": low_mfu,
}


class Advisor:
    """`observe(record)` once a step: the advice that fires on the window ending there."""

    def __init__(self, facts: RunFacts | None = None, window_steps: int = 10) -> None:
        if window_steps < 1:
            raise ValueError(f"monitor.advisor_window_steps must be >= 1, got {window_steps}")
        self.facts = facts or RunFacts()
        self._window: deque[dict[str, Any]] = deque(maxlen=window_steps)

    def observe(self, record: dict[str, Any]) -> list[Advice]:
        self._window.append(record)
        window = list(self._window)
        step = int(record.get("step", 0))
        return [
            Advice(rule, step, message)
            for rule, check in RULES.items()
            if (message := check(window, self.facts)) is not None
        ]


def flags(advice: list[Advice]) -> dict[str, float]:
    """`advisor/<rule>`: 1.0 for each rule in `advice`, 0.0 for every other."""
    fired = {a.rule for a in advice}
    return {f"advisor/{rule}": float(rule in fired) for rule in RULES}


def verdict(advice: list[Advice]) -> str:
    """The console's short form: `ok`, or the rules that fire."""
    return ",".join(a.rule for a in advice) or "ok"
