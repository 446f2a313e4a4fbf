"""The data model: Sample invariants, prompt cloning, staleness."""

from __future__ import annotations

import pytest

from verst.types import Sample, Status, group_staleness


def sample(**kw) -> Sample:
    base = dict(
        prompt="1+1=",
        label="2",
        tokens=[5, 6, 7, 8, 9],
        response_length=2,
        loss_mask=[1, 1],
        rollout_logprobs=[-0.1, -0.2],
    )
    return Sample(**(base | kw))


def test_prompt_and_response_split() -> None:
    s = sample()
    assert s.prompt_length == 3
    assert s.prompt_tokens == [5, 6, 7]
    assert s.response_tokens == [8, 9]
    s.validate()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(loss_mask=[1]), "loss_mask has length 1"),
        (dict(rollout_logprobs=[0.0, 0.0, 0.0]), "rollout_logprobs has length 3"),
        (dict(response_length=6), "response_length 6"),
    ],
)
def test_validate_rejects_inconsistent_lengths(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample(**changes).validate()


def test_clone_prompt_keeps_the_prompt_side_only() -> None:
    s = sample(
        reward=1.0,
        status=Status.COMPLETED,
        weight_versions=[3],
        group_index=4,
        metadata={"source": "x"},
        prompt_id=11,
        epoch=2,
        retries=1,
    )
    clone = s.clone_prompt(index=2)
    assert clone.tokens == [5, 6, 7] and clone.response_length == 0
    assert clone.reward is None and clone.status == Status.PENDING
    assert clone.weight_versions == [] and clone.loss_mask == []
    assert (clone.group_index, clone.index, clone.label) == (4, 2, "2")
    assert (clone.prompt_id, clone.epoch, clone.retries) == (11, 2, 1)  # the same prompt
    clone.metadata["source"] = "changed"
    assert s.metadata["source"] == "x"  # deep copy


def test_staleness_is_pessimistic_over_the_group() -> None:
    group = [sample(weight_versions=[5, 7]), sample(weight_versions=[6])]
    assert group[0].oldest_weight_version == 5
    assert group_staleness(group, current_version=8) == 3  # 8 - oldest (5)
    assert group_staleness([sample()], current_version=8) is None
