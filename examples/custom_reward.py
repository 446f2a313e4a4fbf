"""An example reward function for `rollout.reward: examples.custom_reward:close_enough`.

A reward function takes a `Sample` and returns a float (it may be `async`). The decoded
response is in `sample.metadata["response_text"]`, the dataset's label in `sample.label`, and
any extra JSONL fields in `sample.metadata`.
"""

from __future__ import annotations

from verst.rollout.rewards import parse_last_number
from verst.types import Sample


def close_enough(sample: Sample) -> float:
    """1.0 for the exact product, 0.5 within 10% of it, else 0.0."""
    answer = parse_last_number(sample.metadata["response_text"])
    target = float(sample.label)
    if answer is None:
        return 0.0
    if answer == target:
        return 1.0
    return 0.5 if abs(answer - target) <= 0.1 * abs(target) else 0.0
