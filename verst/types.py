"""The data model shared by every part: `Sample` (one trajectory), its `Status`, and groups;
and the shape letters that end every tensor's name.

Per-token arrays (`loss_mask`, `rollout_logprobs`, `teacher_logprobs`) cover the response only:
they have length `response_length`, and the response is the last `response_length` ids of
`tokens`.

A tensor's name ends with one letter per axis, so `logprobs_B_T` is [B, T]:

    B  batch rows, one sequence each (a sample in training, a request in an engine step)
    T  tokens along a row (response tokens in training; the tokens a forward feeds per row)
    S  positions a row attends to: prompt, earlier tokens and T (the key/value length)
    L  prompt tokens (of a left-padded prompt)
    K  distinct prompts, i.e. groups, of a batch
    G  samples per group
    N  tokens flattened over rows (B·T), the rows of a kernel
    V  vocabulary
    E  model width (hidden size)
    H  attention heads
    D  head dimension
    I  MLP intermediate width
    P  KV-cache pages of a row
    Q  query rows of grouped-query attention (query heads per KV head × T)
    M  metadata columns (the model runner's packed decode inputs)
    X  any other axis, said where it is made (a model output's features: V, or 1 for a critic)
    1  an axis of size one, kept for broadcasting
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any

import torch


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # the model stopped by itself (EOS or a stop token)
    TRUNCATED = "truncated"  # hit max_new_tokens or max_seq_len
    ABORTED = "aborted"  # generation was cancelled; the trajectory is incomplete
    FAILED = "failed"  # an error (engine, agent or reward) spoiled the trajectory


LORA_ADAPTER_KEY = "lora_adapter"  # a prompt row's adapter in a multi-LoRA run


@dataclass
class Sample:
    """One trajectory: a prompt and the model's response to it."""

    prompt: str | list[dict[str, Any]] = ""
    label: Any = None
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    # loss.opd: the teacher's log-prob of each response token (None until a teacher scores it)
    teacher_logprobs: list[float] | None = None
    reward: float | None = None
    status: Status = Status.PENDING
    weight_versions: list[int] = field(default_factory=list)  # one per generation call (turn)
    metadata: dict[str, Any] = field(default_factory=dict)
    group_index: int = 0  # which prompt of the rollout batch this sample belongs to
    index: int = 0  # position inside its group
    # The prompt's identity, kept by every copy of it (`clone_prompt`, a retry): its row in the
    # data file or task split (0-based, file order, before shuffling), the data source's epoch
    # that served it, and how often it was given back after a group that could not be trained.
    prompt_id: int | None = None
    epoch: int | None = None
    retries: int = 0
    # MoE: the experts each position but the last was routed to at rollout, int32
    # [len(tokens) − 1, layers, top_k] (SGLang's routed_experts); None when not asked for
    routed_experts: torch.Tensor | None = None

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter this trajectory belongs to in a multi-LoRA run (its prompt row's
        `lora_adapter`), else None."""
        return self.metadata.get(LORA_ADAPTER_KEY)

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
        for name in ("loss_mask", "rollout_logprobs", "teacher_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != self.response_length:
                raise ValueError(
                    f"{name} has length {len(values)}, "
                    f"expected response_length {self.response_length}"
                )

    def clone_prompt(self, index: int) -> Sample:
        """A fresh sample with this one's prompt side (and identity) and no outputs."""
        return Sample(
            prompt=copy.deepcopy(self.prompt),
            label=copy.deepcopy(self.label),
            tokens=list(self.prompt_tokens),
            metadata=copy.deepcopy(self.metadata),
            group_index=self.group_index,
            index=index,
            prompt_id=self.prompt_id,
            epoch=self.epoch,
            retries=self.retries,
        )

    @property
    def scored(self) -> bool:
        """Whether this sample can be trained on: neither ABORTED nor FAILED."""
        return self.status not in (Status.ABORTED, Status.FAILED)


Group = list[Sample]
"""The samples generated from one prompt; scheduling, buffering and dropping are per group."""


def scored_count(group: Group) -> int:
    """The samples of `group` that can be trained on (neither ABORTED nor FAILED)."""
    return sum(sample.scored for sample in group)


def group_staleness(group: Group, current_version: int) -> int | None:
    """current version − oldest version of any token in the group (pessimistic); None if unknown."""
    versions = [v for sample in group for v in sample.weight_versions]
    return current_version - min(versions) if versions else None
