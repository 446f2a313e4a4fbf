"""The advisor's rules on synthetic windows of metrics: each fires past its threshold, naming
the config field to change, and stays quiet below it or without its metrics."""

from __future__ import annotations

import pytest

from verst.monitor import advisor
from verst.monitor.advisor import Advisor, RunFacts


def steps(n: int, **metrics: float) -> list[dict]:
    return [{"step": s, **metrics} for s in range(1, n + 1)]


def fired(window: list[dict], facts: RunFacts | None = None) -> dict[str, str]:
    watcher = Advisor(facts, window_steps=len(window))
    advice = [watcher.observe(row) for row in window][-1]
    return {a.rule: a.message for a in advice}


def test_a_step_over_six_times_the_median_is_a_stall_naming_its_slowest_phase() -> None:
    window = steps(5, **{"perf/step_time_s": 1.0})
    window.append({"step": 6, "perf/step_time_s": 6.5, "perf/rollout_time_s": 6.0,
                   "perf/train_time_s": 0.5})  # fmt: skip
    message = fired(window)["stall"]
    assert "6.5 s, 6.5x the median 1 s" in message and "phase rollout" in message
    assert "monitor.trace" in message
    window[-1]["perf/step_time_s"] = 5.9
    assert "stall" not in fired(window)
    assert "stall" not in fired(steps(2, **{"perf/step_time_s": 1.0}) + [window[-1]])  # too short


@pytest.mark.parametrize(
    ("key", "bad", "good", "rule", "field"),
    [
        ("rollout/aborted_ratio", 0.06, 0.0, "aborts", "rollout.pause_mode"),
        ("rollout/agent_aborted_ratio", 0.2, 0.0, "aborts", "rollout.pause_mode"),
        ("rollout/zero_std_ratio", 0.6, 0.0, "zero_std", "rollout.dynamic_sampling=true"),
        ("rollout/truncated_ratio", 0.3, 0.0, "truncation", "rollout.max_new_tokens"),
        ("perf/mfu", 0.1, 0.5, "low_mfu", "trainer.micro_batch_tokens"),
    ],
)
def test_ratio_rules_fire_on_the_window_mean(
    key: str, bad: float, good: float, rule: str, field: str
) -> None:
    assert field in fired(steps(4, **{key: bad}))[rule]
    # the window's mean decides: one bad step among good ones is not enough
    assert rule not in fired(steps(3, **{key: good}) + [{"step": 4, key: bad}])


@pytest.mark.parametrize(
    ("key", "quiet"),
    [
        ("rollout/aborted_ratio", 0.05),
        ("rollout/zero_std_ratio", 0.5),
        ("rollout/truncated_ratio", 0.25),
        ("perf/mfu", 0.15),
    ],
)
def test_ratio_rules_are_quiet_at_their_threshold(key: str, quiet: float) -> None:
    assert fired(steps(4, **{key: quiet})) == {}


def test_the_truncation_advice_gives_the_mean_length() -> None:
    window = steps(3, **{"rollout/truncated_ratio": 1.0, "rollout/response_len_mean": 4.0})
    assert "100% of responses" in fired(window)["truncation"]
    assert "mean length 4 tokens" in fired(window)["truncation"]


def test_kv_full_fires_only_at_low_concurrency() -> None:
    full = {"engine/token_usage": 0.95, "engine/sampled_engines": 2.0}
    facts = RunFacts(max_batch_size=64)
    message = fired(steps(3, **full, **{"engine/num_running_reqs": 20.0}), facts)["kv_full"]
    assert "95% full with 10 requests running an engine" in message
    assert "placement.max_batch_size=64" in message and "rollout.max_new_tokens" in message
    assert fired(steps(3, **full, **{"engine/num_running_reqs": 64.0}), facts) == {}
    half = full | {"engine/token_usage": 0.5, "engine/num_running_reqs": 2.0}
    assert fired(steps(3, **half), facts) == {}


def test_cache_hit_fires_only_in_multi_turn_runs() -> None:
    low = {"engine/cache_hit_rate": 0.05}
    assert (
        "5% of prompt tokens"
        in fired(steps(3, **low, **{"rollout/agent_turns_mean": 3.0}))["cache_hit"]
    )
    assert fired(steps(3, **low, **{"rollout/agent_turns_mean": 1.0})) == {}
    assert fired(steps(3, **low)) == {}
    assert fired(steps(3, **{"engine/cache_hit_rate": 0.4, "rollout/agent_turns_mean": 3.0})) == {}


@pytest.mark.parametrize(
    ("key", "rule", "field"),
    [
        ("buffer/rollout_bound", "rollout_bound", "rollout.max_inflight"),
        ("buffer/trainer_bound", "trainer_bound", "rollout.buffer_factor"),
    ],
)
def test_bound_rules_fire_in_fully_async_mode_only(key: str, rule: str, field: str) -> None:
    window = steps(3, **{key: 1.0})
    assert field in fired(window, RunFacts(mode="fully_async"))[rule]
    assert fired(window, RunFacts(mode="sync")) == {}
    assert fired(steps(3, **{key: 0.0}), RunFacts(mode="fully_async")) == {}


def test_non_finite_and_missing_metrics_keep_rules_quiet() -> None:
    window = steps(4, **{"rollout/truncated_ratio": float("nan"), "perf/step_time_s": 1.0})
    assert fired(window) == {}
    assert fired([{"step": 1}]) == {}


def test_flags_name_every_rule_and_the_window_slides() -> None:
    watcher = Advisor(window_steps=2)
    for row in steps(2, **{"rollout/truncated_ratio": 1.0}):
        advice = watcher.observe(row)
    flags = advisor.flags(advice)
    assert set(flags) == {f"advisor/{rule}" for rule in advisor.RULES}
    assert flags["advisor/truncation"] == 1.0 and sum(flags.values()) == 1.0
    assert advisor.verdict(advice) == "truncation" and advisor.verdict([]) == "ok"
    watcher.observe({"step": 3, "rollout/truncated_ratio": 0.0})
    assert watcher.observe({"step": 4, "rollout/truncated_ratio": 0.0}) == []  # 1.0 slid out


def test_facts_come_from_the_config_and_a_bad_window_is_refused() -> None:
    facts = RunFacts.from_config({"mode": "fully_async", "placement": {"max_batch_size": 8}})
    assert facts == RunFacts(mode="fully_async", max_batch_size=8)
    assert RunFacts.from_config({}) == RunFacts()
    with pytest.raises(ValueError, match="monitor.advisor_window_steps"):
        Advisor(window_steps=0)
