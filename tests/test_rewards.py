"""Built-in rewards, loading by import path, and how RewardScorer fails samples: errors, bad
values, SystemExit, timeouts; one log line per kind of failure; Ctrl-C still stops the run."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import types

import pytest

from verst.plugin_loader import PluginError
from verst.rollout.rewards import (
    RewardScorer,
    compute_rewards,
    exact_match,
    load_reward_fn,
    numeric_match,
    parse_last_number,
)
from verst.types import Sample, Status


def sample(response: str, label) -> Sample:
    return Sample(prompt="q", label=label, metadata={"response_text": response})


def test_exact_match():
    assert exact_match(sample(" 65\n", "65")) == 1.0
    assert exact_match(sample("65", 65)) == 1.0
    assert exact_match(sample("065", "65")) == 0.0
    assert exact_match(sample("", "65")) == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("65", 65.0),
        ("The answer is 65.", 65.0),
        ("first 3, then -12.5", -12.5),
        ("total: $1,234,567.50!", 1234567.5),
        ("12,34", 34.0),
        ("8-3", 3.0),
        ("x = -7", -7.0),
        ("about .5", 0.5),
        ("no digits here", None),
    ],
)
def test_parse_last_number(text, expected):
    assert parse_last_number(text) == expected


def test_numeric_match():
    assert numeric_match(sample("so it is 65.0", "65")) == 1.0
    assert numeric_match(sample("1,000", 1000)) == 1.0
    assert numeric_match(sample("0.30000000001", 0.3)) == 1.0
    assert numeric_match(sample("-4", "4")) == 0.0
    assert numeric_match(sample("65 or 66", "65")) == 0.0
    assert numeric_match(sample("nothing", "65")) == 0.0
    assert numeric_match(sample("65", None)) == 0.0


def test_load_reward_fn():
    assert load_reward_fn("exact_match") is exact_match
    assert load_reward_fn("numeric_match") is numeric_match
    assert load_reward_fn("verst.rollout.rewards:numeric_match") is numeric_match
    with pytest.raises(ValueError, match="'nope'.*exact_match"):
        load_reward_fn("nope")
    with pytest.raises(PluginError, match="'no_such_mod:fn'"):
        load_reward_fn("no_such_mod:fn")
    with pytest.raises(PluginError, match="'verst.rollout.rewards:missing'"):
        load_reward_fn("verst.rollout.rewards:missing")


def test_compute_rewards_sync_and_failures():
    samples = [
        sample("65", "65"),
        sample("64", "65"),
        sample("boom", "65"),
        sample("str", "1"),
        sample("bool", "1"),
        sample("none", "1"),
    ]

    def fn(s: Sample):
        text = s.metadata["response_text"]
        if text == "boom":
            raise RuntimeError("verifier crashed")
        if text == "str":
            return "1.0"
        if text == "bool":
            return True
        if text == "none":
            return None
        return exact_match(s)

    asyncio.run(compute_rewards(samples, fn))
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert samples[5].status is Status.FAILED
    assert [s.status for s in samples[:2]] == [Status.PENDING, Status.PENDING]
    assert samples[2].status is Status.FAILED
    assert "verifier crashed" in samples[2].metadata["reward_error"]
    assert samples[3].status is Status.FAILED
    assert "not a number" in samples[3].metadata["reward_error"]


def test_compute_rewards_async_runs_concurrently():
    n = 20
    started = 0
    all_started = asyncio.Event()

    async def fn(s: Sample) -> float:
        nonlocal started
        started += 1
        if started == n:
            all_started.set()
        # Every call waits for all the others: this only finishes if they run concurrently.
        await asyncio.wait_for(all_started.wait(), timeout=5)
        return numeric_match(s)

    async def main():
        samples = [sample(str(i), i % 2) for i in range(n)]
        await compute_rewards(samples, fn)
        return samples

    samples = asyncio.run(main())
    assert [s.reward for s in samples] == [float(i in (0, 1)) for i in range(n)]


def test_async_reward_fn_loaded_by_path(monkeypatch):
    module = types.ModuleType("user_rewards")

    async def length_reward(s: Sample) -> int:
        await asyncio.sleep(0)
        return len(s.metadata["response_text"])

    module.length_reward = length_reward
    monkeypatch.setitem(sys.modules, "user_rewards", module)
    fn = load_reward_fn("user_rewards:length_reward")
    samples = [sample("abc", None)]
    asyncio.run(compute_rewards(samples, fn))
    assert samples[0].reward == 3.0 and isinstance(samples[0].reward, float)


def test_every_kind_of_failure_fails_only_its_sample_and_is_logged_once(caplog):
    def fn(s: Sample):
        text = s.metadata["response_text"]
        if text == "raise":
            raise ValueError(f"cannot parse {s.label}")
        if text == "exit":
            sys.exit(3)  # a verifier that calls sys.exit must not end the run
        return {"nan": float("nan"), "none": None, "str": "1.0", "inf": float("inf")}.get(text, 1)

    texts = ["raise", "raise", "exit", "nan", "nan", "none", "str", "inf", "ok"]
    samples = [sample(t, i) for i, t in enumerate(texts)]
    scorer = RewardScorer(fn, timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="verst.rollout.rewards"):
        scorer.score_groups([samples])
    assert [s.status for s in samples] == [Status.FAILED] * 8 + [Status.PENDING]
    assert [s.reward for s in samples] == [0.0] * 8 + [1.0]
    errors = [s.metadata.get("reward_error") for s in samples]
    assert errors[:3] == [
        "ValueError: cannot parse 0",
        "ValueError: cannot parse 1",
        "SystemExit: 3",
    ]
    assert errors[3] == "reward function returned non-finite nan"
    assert "NoneType None, not a number" in errors[5] and "str '1.0'" in errors[6]
    # one line per kind: ValueError, SystemExit, nan, NoneType, str, inf
    assert len(caplog.records) == 6, [r.getMessage() for r in caplog.records]
    assert "rollout.reward failed (returned nan)" in caplog.text
    assert scorer.take_failed() == 8 and scorer.take_failed() == 0
    caplog.clear()
    again = sample("raise", 9)
    scorer.score_groups([[again]])  # the same kind again: counted, not logged
    assert again.status is Status.FAILED and not caplog.records and scorer.take_failed() == 1


@pytest.mark.parametrize("timeout_s", [5.0, None])
def test_async_reward_failures_and_system_exit(timeout_s):
    async def fn(s: Sample) -> float:
        await asyncio.sleep(0)
        if s.label == 0:
            raise SystemExit("verifier quit")
        if s.label == 1:
            raise KeyError("answer")
        return float("nan") if s.label == 2 else 0.5

    samples = [sample("x", i) for i in range(4)]
    RewardScorer(fn, timeout_s=timeout_s).score_groups([samples])
    assert [s.metadata.get("reward_error") for s in samples] == [
        "SystemExit: verifier quit",
        "KeyError: 'answer'",
        "reward function returned non-finite nan",
        None,
    ]
    assert samples[3].reward == 0.5


@pytest.mark.parametrize("timeout_s", [5.0, None])
def test_keyboard_interrupt_still_stops_the_run(timeout_s):
    def sync_fn(s: Sample) -> float:
        raise KeyboardInterrupt

    async def async_fn(s: Sample) -> float:
        raise KeyboardInterrupt

    for fn in (sync_fn, async_fn):
        with pytest.raises(KeyboardInterrupt):
            RewardScorer(fn, timeout_s=timeout_s).score_groups([[sample("x", 1)]])


def test_a_hung_reward_times_out_and_the_step_goes_on(caplog):
    """A sync reward that never returns fails its sample after the timeout, and the reward
    phase returns (its thread is left behind, a daemon); the calls after it still run."""
    release = threading.Event()

    def fn(s: Sample) -> float:
        if s.label == "hang":
            release.wait(30)
        return 1.0

    async def async_fn(s: Sample) -> float:
        if s.label == "hang":
            await asyncio.sleep(30)
        return 1.0

    try:
        for reward_fn in (fn, async_fn):
            samples = [sample("x", label) for label in ("ok", "hang", "ok")]
            scorer = RewardScorer(reward_fn, timeout_s=0.2)
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="verst.rollout.rewards"):
                scorer.score_groups([samples])
            assert time.monotonic() - started < 3
            assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
            assert samples[1].status is Status.FAILED
            assert samples[1].metadata["reward_error"] == "reward timed out after 0.2 s"
            assert "rollout.reward failed (timed out)" in caplog.text
            caplog.clear()
    finally:
        release.set()


def test_sync_rewards_run_one_at_a_time_each_timed_from_its_start():
    """Sync calls keep running one at a time, as on the caller's thread, and the timeout
    bounds each call, not the wait for the ones before it."""
    running, peak = 0, 0
    lock = threading.Lock()

    def fn(s: Sample) -> float:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return 1.0

    samples = [sample("x", i) for i in range(8)]  # 0.4 s in all, each call 0.05 s
    RewardScorer(fn, timeout_s=0.25).score_groups([samples])
    assert [s.reward for s in samples] == [1.0] * 8 and peak == 1


def test_without_a_timeout_a_sync_reward_runs_on_the_callers_thread():
    threads = []

    def fn(s: Sample) -> float:
        threads.append(threading.current_thread())
        return 1.0

    RewardScorer(fn, timeout_s=None).score_groups([[sample("x", 1)]])
    RewardScorer(fn, timeout_s=1).score_groups([[sample("x", 1)]])
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()
    with pytest.raises(ValueError, match="timeout"):
        RewardScorer(fn, timeout_s=0)
