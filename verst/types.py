"""The data model shared by every part: `Sample` (one trajectory), its `Status`, and groups.

Per-token arrays (`loss_mask`, `rollout_logprobs`) cover the response only: they have length
`response_length`, and the response is the last `response_length` ids of `tokens`.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # the model stopped by itself (EOS or a stop token)
    TRUNCATED = "truncated"  # hit max_new_tokens or max_seq_len
    ABORTED = "aborted"  # generation was cancelled; the trajectory is incomplete
    FAILED = "failed"  # an error (engine, agent or reward) spoiled the trajectory


@dataclass
class Sample:
    """One trajectory: a prompt and the model's response to it."""

    prompt: str | list[dict[str, Any]] = ""
    label: Any = None
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    reward: float | None = None
    status: Status = Status.PENDING
    weight_versions: list[int] = field(default_factory=list)  # one per generation call (turn)
    metadata: dict[str, Any] = field(default_factory=dict)
    group_index: int = 0  # which prompt of the rollout batch this sample belongs to
    index: int = 0  # position inside its group

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def oldest_weight_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    def validate(self) -> None:
        """Raise ValueError when the per-token arrays disagree with `response_length`."""
        if not 0 <= self.response_length <= len(self.tokens):
            raise ValueError(
                f"response_length {self.response_length} outside 0..len(tokens)={len(self.tokens)}"
            )
        for name in ("loss_mask", "rollout_logprobs"):
            values = getattr(self, name)
            if len(values) != self.response_length:
                raise ValueError(
                    f"{name} has length {len(values)}, "
                    f"expected response_length {self.response_length}"
                )

    def clone_prompt(self, index: int) -> Sample:
        """A fresh sample with this one's prompt side and no outputs."""
        return Sample(
            prompt=copy.deepcopy(self.prompt),
            label=copy.deepcopy(self.label),
            tokens=list(self.prompt_tokens),
            metadata=copy.deepcopy(self.metadata),
            group_index=self.group_index,
            index=index,
        )


Group = list[Sample]
"""The samples generated from one prompt; scheduling, buffering and dropping are per group."""


def group_staleness(group: Group, current_version: int) -> int | None:
    """current version − oldest version of any token in the group (pessimistic); None if unknown."""
    versions = [v for sample in group for v in sample.weight_versions]
    return current_version - min(versions) if versions else None
