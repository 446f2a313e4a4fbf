"""DAPO dynamic sampling: zero-variance groups are dropped and the batch is refilled."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.test_loop import SMALL
from verst.cli import main
from verst.rollout.dynamic import fill_batch, has_reward_variance
from verst.types import Sample, Status

CPU = torch.device("cpu")


def group(*rewards: float) -> list[Sample]:
    return [Sample(reward=r) for r in rewards]


def test_zero_variance_groups_carry_no_signal() -> None:
    assert has_reward_variance(group(0.0, 1.0))
    assert not has_reward_variance(group(1.0, 1.0, 1.0))
    assert not has_reward_variance(group(1.0))
    # failed and aborted samples are not trained on: their 0.0 is no signal
    failed = group(1.0, 0.0, 1.0)
    failed[1].status = Status.FAILED
    assert not has_reward_variance(failed)
    aborted = group(1.0, 0.0, 0.0)
    aborted[0].status = Status.ABORTED
    assert not has_reward_variance(aborted)


def test_rounds_until_the_batch_is_full() -> None:
    first = [group(0, 0), group(0, 1), group(1, 1)]  # one informative group
    second = [group(1, 0), group(0, 0), group(0, 1), group(1, 0)]  # three more
    rounds = iter([first, second])
    filled = fill_batch(lambda: next(rounds), 3, max_rounds=4, device=CPU)
    assert filled.groups == [first[1], second[0], second[2]]
    # the informative group beyond the batch is not lost: the rollout gives it back
    assert filled.surplus == [second[3]]
    reason = "no reward variance"
    assert filled.rejected == [(first[0], reason), (first[2], reason), (second[1], reason)]
    assert filled.metrics["rollout/dynamic_sampling_rounds"] == 2
    assert filled.metrics["rollout/dynamic_sampling_dropped_groups"] == 3
    assert filled.metrics["rollout/dynamic_sampling_short_groups"] == 0


def test_round_limit_trains_on_what_it_has() -> None:
    filled = fill_batch(lambda: [group(0, 0), group(0, 1)], 4, max_rounds=2, device=CPU)
    assert len(filled.groups) == 2 and filled.surplus == []
    assert filled.metrics["rollout/dynamic_sampling_short_groups"] == 2
    # nothing informative at all: the last draw is used (zero advantages, no policy gradient),
    # and only the earlier rounds' groups are rejected
    draws = iter([[group(0, 0)], [group(1, 1)]])
    filled = fill_batch(lambda: next(draws), 2, max_rounds=2, device=CPU)
    assert len(filled.groups) == 1 and filled.groups[0][0].reward == 1
    assert len(filled.rejected) == 1 and filled.rejected[0][0][0].reward == 0


def test_dynamic_sampling_through_the_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "train",
        *SMALL,
        "num_steps=2",
        "rollout.dynamic_sampling=true",
        "rollout.max_sampling_rounds=3",
        "--run-dir",
        str(run_dir),
    ]
    assert main(args) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        assert 1 <= row["rollout/dynamic_sampling_rounds"] <= 3
        assert (
            row["rollout/zero_std_ratio"] == 0.0 or row["rollout/dynamic_sampling_short_groups"] > 0
        )
