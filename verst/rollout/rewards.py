"""Reward functions: the built-ins, loading one by import path, and scoring a batch of Samples.

A reward function takes a `Sample` and returns a number (sync or async). It reads the response
text from `sample.metadata["response_text"]` (the rollout decodes it with skip_special_tokens).
`compute_rewards` never lets one bad sample stop the run: a reward function that raises or
returns a non-number marks that sample FAILED with reward 0.0 and the reason in
`metadata["reward_error"]`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
from typing import Any

from verst.plugins import PluginError, RewardFunction, load_plugin
from verst.types import Group, Sample, Status

# Thousands separators only in well-formed groups ("1,234,567"), so "3,4" reads as 3 then 4;
# a minus right after a word character is an operator ("8-3" ends in 3, not -3).
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


def _response_text(sample: Sample) -> str:
    return str(sample.metadata.get("response_text", ""))


def exact_match(sample: Sample) -> float:
    """1.0 when the response, stripped, equals str(label), stripped; else 0.0."""
    return float(_response_text(sample).strip() == str(sample.label).strip())


def parse_last_number(text: str) -> float | None:
    """The last number in `text` (ints, decimals, negatives, 1,234 thousands); None if none."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return float(matches[-1].replace(",", ""))


def numeric_match(sample: Sample) -> float:
    """1.0 when the last number in the response equals the label within 1e-6; else 0.0."""
    got = parse_last_number(_response_text(sample))
    if got is None:
        return 0.0
    try:
        want = float(str(sample.label).replace(",", "").strip())
    except ValueError:
        want = parse_last_number(str(sample.label))
        if want is None:
            return 0.0
    return float(abs(got - want) <= 1e-6)


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
}


def load_reward_fn(path: str, *, field: str = "rollout.reward") -> RewardFunction:
    """A built-in by bare name ("exact_match", "numeric_match"), or any 'pkg.mod:fn' that takes
    a Sample; `PluginError` naming `field` and `path` otherwise."""
    if ":" not in path and "." not in path:
        if path not in BUILTIN_REWARDS:
            raise PluginError(
                f"{field}: unknown reward function {path!r}: built-ins are "
                f"{', '.join(sorted(BUILTIN_REWARDS))}; or give an import path 'pkg.mod:fn'"
            )
        return BUILTIN_REWARDS[path]
    return load_plugin(path, RewardFunction, field=field)


def _fail(sample: Sample, reason: str) -> None:
    sample.reward = 0.0
    sample.status = Status.FAILED
    sample.metadata["reward_error"] = reason


def _set(sample: Sample, value: Any) -> None:
    # Accept anything number-like (bool, numpy scalars, one-element tensors), never text: a
    # reward of "1.0" is almost certainly a bug in the reward function.
    try:
        if isinstance(value, (str, bytes)) or not (
            isinstance(value, numbers.Real) or hasattr(value, "__float__")
        ):
            raise TypeError
        value = float(value)
    except (TypeError, ValueError, RuntimeError):
        _fail(sample, f"reward function returned {type(value).__name__} {value!r}, not a number")
        return
    if not math.isfinite(value):
        _fail(sample, f"reward function returned non-finite {value}")
        return
    sample.reward = value


async def _score(sample: Sample, fn: RewardFunction) -> None:
    try:
        value = fn(sample)
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:  # one bad sample must not stop the run
        _fail(sample, f"{type(exc).__name__}: {exc}")
        return
    _set(sample, value)


async def compute_rewards(samples: list[Sample], fn: RewardFunction) -> None:
    """Set `sample.reward` on every sample; async reward functions run concurrently."""
    await asyncio.gather(*(_score(sample, fn) for sample in samples))


def score_groups(groups: list[Group], fn: RewardFunction) -> None:
    """The reward phase of a step: every sample not scored yet gets its reward (the reward
    function may read what an agent returned in `metadata`); ABORTED samples get 0.0."""
    unscored = []
    for sample in (s for group in groups for s in group):
        if sample.status == Status.ABORTED:
            sample.reward = 0.0
        elif sample.reward is None:
            unscored.append(sample)
    if unscored:
        asyncio.run(compute_rewards(unscored, fn))
