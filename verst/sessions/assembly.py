"""Assembly: a session's per-turn token records → one training `Sample`.

Pure and exact. The session server records, per turn, the ids it sent (`input_ids`) and the ids
the engine sampled with their log-probs and weight version. Each turn's input starts with the
previous turn's input + output verbatim (the server never re-tokenises), so the whole session is
the last turn's input + output, and every token is either sampled by the model (loss mask 1,
its rollout log-prob) or written by someone else — prompt, tool result, environment text
(mask 0, log-prob 0.0). Per-token arrays cover the response: everything after the first turn's
prompt.

Truncation at `max_seq_len` cuts on a turn boundary: whole turns that do not fit are dropped
from the end and the sample becomes TRUNCATED. Only when the first turn alone does not fit is
its output cut short (its prompt must fit), since nothing earlier could stand in for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verst.types import Sample, Status

FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class AssemblyError(ValueError):
    """The records cannot form a sample (empty session, inconsistent records, too long)."""


@dataclass(frozen=True)
class TurnRecord:
    """One generation call of a session, exactly as the engine saw and answered it."""

    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    weight_version: int | str
    finish_reason: str  # "stop", "length" or "abort"
    # MoE, when the session server asks for them: the experts of every fed position of
    # input + output, int32 [len(total_ids) − 1, layers × top_k] (cached positions keep the
    # routing of the forward that computed them, an earlier turn's)
    routed_experts: torch.Tensor | None = None

    @property
    def total_ids(self) -> list[int]:
        return self.input_ids + self.output_ids


def _as_version(version: int | str) -> int:
    """Engines report versions as strings (SGLang); `Sample.weight_versions` holds ints."""
    try:
        return int(version)
    except (TypeError, ValueError) as error:
        raise AssemblyError(f"weight version {version!r} is not an integer") from error


def _status(finish_reason: str) -> Status:
    if finish_reason == FINISH_LENGTH:
        return Status.TRUNCATED
    if finish_reason == FINISH_ABORT:
        return Status.ABORTED
    return Status.COMPLETED


def check_records(records: Sequence[TurnRecord]) -> None:
    """Raise `AssemblyError` unless each turn extends the previous one token for token."""
    if not records:
        raise AssemblyError("the session has no turns: no generation call was recorded")
    for i, record in enumerate(records):
        if len(record.output_logprobs) != len(record.output_ids):
            raise AssemblyError(
                f"turn {i} has {len(record.output_ids)} output ids but "
                f"{len(record.output_logprobs)} log-probs"
            )
        if not record.input_ids:
            raise AssemblyError(f"turn {i} has no input ids")
        if i == 0:
            continue
        before = records[i - 1].total_ids
        if record.input_ids[: len(before)] != before:
            pairs = zip(before, record.input_ids, strict=False)
            at = next(
                (j for j, (a, b) in enumerate(pairs) if a != b),
                min(len(before), len(record.input_ids)),
            )
            raise AssemblyError(
                f"turn {i}'s input ids do not start with turn {i - 1}'s input + output ids "
                f"(first difference at position {at} of {len(before)})"
            )


def assemble(records: Sequence[TurnRecord], *, max_seq_len: int | None = None) -> Sample:
    """The session as one Sample: tokens, response-aligned loss mask and rollout log-probs,
    one weight version per kept turn, and a status (see the module docstring)."""
    check_records(records)
    kept = list(records)
    status: Status | None = None
    if max_seq_len is not None:
        if max_seq_len <= 0:
            raise AssemblyError(f"max_seq_len must be positive, got {max_seq_len}")
        while kept and len(kept[-1].total_ids) > max_seq_len:
            kept.pop()
        if len(kept) < len(records):
            status = Status.TRUNCATED
        if not kept:
            first = records[0]
            if len(first.input_ids) >= max_seq_len:
                raise AssemblyError(
                    f"the first turn's prompt alone has {len(first.input_ids)} tokens; "
                    f"max_seq_len {max_seq_len} leaves no room for a response"
                )
            keep_out = max_seq_len - len(first.input_ids)
            kept = [
                TurnRecord(
                    first.input_ids,
                    first.output_ids[:keep_out],
                    first.output_logprobs[:keep_out],
                    first.weight_version,
                    FINISH_LENGTH,
                    first.routed_experts,
                )
            ]
    prompt_length = len(kept[0].input_ids)
    loss_mask: list[int] = []
    logprobs: list[float] = []
    done = prompt_length
    for record in kept:
        written = len(record.input_ids) - done  # tokens nobody sampled: tool, user, template
        loss_mask += [0] * written + [1] * len(record.output_ids)
        logprobs += [0.0] * written + [float(lp) for lp in record.output_logprobs]
        done = len(record.total_ids)
    last = kept[-1]
    sample = Sample(
        tokens=list(last.total_ids),
        response_length=len(last.total_ids) - prompt_length,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        status=status or _status(last.finish_reason),
        weight_versions=[_as_version(r.weight_version) for r in kept],
        metadata={"num_turns": len(kept), "dropped_turns": len(records) - len(kept)},
        routed_experts=_routed_experts(last, len(last.total_ids)),
    )
    sample.validate()
    return sample


def _routed_experts(last: TurnRecord, tokens: int) -> torch.Tensor | None:
    """The session's experts: the last kept turn's record covers every earlier position too
    (its prompt is the turns before it); cut to the kept tokens."""
    if last.routed_experts is None:
        return None
    if last.routed_experts.shape[0] < tokens - 1:
        raise AssemblyError(
            f"the last turn's routed_experts cover {last.routed_experts.shape[0]} positions, "
            f"the session has {tokens - 1}"
        )
    return last.routed_experts[: tokens - 1]
