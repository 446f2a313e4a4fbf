"""Built-in rewards, loading by import path, and compute_rewards' failure handling."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest

from verst.plugins import PluginError
from verst.rollout.rewards import (
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
