"""An example reward function for `rollout.reward: examples.custom_reward:product_reward`.

A reward function takes a `Sample` and returns a float (it may be `async`). The decoded
response is in `sample.metadata["response_text"]`, the dataset's label in `sample.label`,
extra JSONL fields in `sample.metadata`, and `sample.status` says whether the model stopped by
itself (COMPLETED) or was cut off (TRUNCATED).
"""

from __future__ import annotations

from verst.rollout.rewards import parse_last_number
from verst.types import Sample, Status


def product_reward(sample: Sample) -> float:
    """1.0 for the right product followed by end-of-sequence, 0.0 otherwise.

    Partial credit (say, for an answer within 10%) is tempting and is a trap: in our runs the
    policy learned to emit long near-miss numbers that never end, and exact accuracy fell.
    """
    if sample.status != Status.COMPLETED:
        return 0.0
    answer = parse_last_number(sample.metadata["response_text"])
    return 1.0 if answer is not None and answer == float(sample.label) else 0.0
