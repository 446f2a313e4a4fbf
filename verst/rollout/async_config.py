"""The fully asynchronous mode's settings (`rollout.async_`): in-flight limit, sample or group
replacement, the buffer's size, staleness bound and class, and what happens to unused groups."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator

from verst.configbase import ConfigBase
from verst.rollout.buffer import DEFAULT_BUFFER, load_buffer_class
from verst.rollout.slots import Replacement


class AsyncConfig(ConfigBase):
    """Fully asynchronous rollout: the worker's in-flight limit and the data buffer."""

    max_inflight: int | None = Field(
        None,
        ge=1,
        description="most trajectories generating at once; null = one step's worth "
        "(prompts_per_step × n_samples_per_prompt)",
    )
    replacement: Replacement = Field(
        "sample",
        description="when a new group starts: 'sample' = once enough finished trajectories have "
        "freed their places, 'group' = only when a whole group has finished",
    )
    buffer_factor: float = Field(
        2.0,
        ge=1.0,
        description="data buffer capacity in train batches: ceil(factor × prompts_per_step) groups",
    )
    max_staleness: int | None = Field(
        4,
        ge=0,
        description="drop a group at take when current version − its oldest token's version "
        "exceeds this, and start none while this many batches wait untrained; null = never",
    )
    wait_for_due: bool = Field(
        True,
        description="fully async: a take waits for groups still generating that would be stale "
        "after it (long ones), so none is dropped; false = drop them when they arrive stale",
    )
    unused: Literal["drop", "retry"] = Field(
        "retry",
        description="fully async: aborted, stale and too-few-scored groups: discard them, or "
        "return their prompts to the data source to be served again",
    )
    buffer: str = Field(
        DEFAULT_BUFFER, description="data buffer class by import path, e.g. pkg.mod:MyBuffer"
    )

    @field_validator("buffer")
    @classmethod
    def _buffer_importable(cls, value: str) -> str:
        load_buffer_class(value)
        return value

    def buffer_capacity(self, prompts_per_step: int) -> int:
        """The buffer's capacity in groups for a train batch of `prompts_per_step` groups."""
        return max(prompts_per_step, math.ceil(self.buffer_factor * prompts_per_step - 1e-9))

    def ahead_limit(self, prompts_per_step: int) -> int | None:
        """Most groups drawn and not yet served (generating or buffered): a group with
        `max_staleness` batches ahead of it would be stale by the time a take reaches it, so
        it is not started (its generation would be thrown away)."""
        if self.max_staleness is None:
            return None
        return max(self.max_staleness, 1) * prompts_per_step

    def inflight_limit(self, prompts_per_step: int, n_samples_per_prompt: int) -> int:
        """`max_inflight`, or one step's worth of trajectories when it is unset."""
        if self.max_inflight is not None:
            return self.max_inflight
        return prompts_per_step * n_samples_per_prompt
