"""DAPO dynamic sampling: keep only groups whose rewards differ, sampling more to fill the batch.

A group whose samples all got the same reward has advantage 0 everywhere under GRPO, so it
adds no signal and only dilutes the batch. With dynamic sampling on, the rollout draws rounds
of `prompts_per_step` prompts until enough informative groups are kept (counted over all
ranks) or `max_sampling_rounds` is reached; a short batch then trains on what it has. Every
rank runs the same number of rounds, so the ranks' data sources stay in step.

Informative groups beyond this rank's share of the batch are not thrown away: `fill_batch`
returns them as `surplus`, and the rollout gives their prompts back to be served again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verst import distributed
from verst.types import Group


def has_reward_variance(group: Group) -> bool:
    """Whether the rewards of the group's scored samples (neither ABORTED nor FAILED: those are
    not trained on) differ."""
    rewards = torch.tensor([s.reward or 0.0 for s in group if s.scored], dtype=torch.float64)
    return len(rewards) > 1 and float(rewards.std()) > 1e-8


@dataclass
class FilledBatch:
    """What `fill_batch` drew: the `groups` to train on, informative `surplus` beyond this rank's
    share, the `rejected` groups (no reward variance), and `rollout/dynamic_sampling_*` metrics."""

    groups: list[Group]
    surplus: list[Group]
    rejected: list[Group]
    metrics: dict[str, float]


def fill_batch(
    draw: Callable[[], list[Group]],
    target_groups: int,
    *,
    max_rounds: int,
    device: torch.device,
) -> FilledBatch:
    """Rounds of `draw()` (this rank's share of one step's groups, generated and scored) until
    `target_groups` informative groups are kept over all ranks."""
    kept: list[Group] = []
    rejected: list[Group] = []
    last: list[Group] = []
    rounds = 0
    while True:
        rounds += 1
        last = draw()
        for group in last:
            (kept if has_reward_variance(group) else rejected).append(group)
        kept_all = distributed.all_reduce_sum([float(len(kept))], device)[0]
        if kept_all >= target_groups or rounds >= max_rounds:
            break
    share = -(-target_groups // distributed.world_size())  # ceil: this rank's part
    dropped_all, short = distributed.all_reduce_sum(
        [float(len(rejected)), float(max(target_groups - kept_all, 0.0))], device
    )
    groups, surplus = kept[:share], kept[share:]
    if not groups:
        # A rank left with nothing trains on its last draw: zero advantages, so no policy
        # gradient, but every rank still takes part in the step's collectives.
        groups = last
        rejected = [g for g in rejected if not any(g is chosen for chosen in last)]
    metrics = {
        "rollout/dynamic_sampling_rounds": float(rounds),
        "rollout/dynamic_sampling_dropped_groups": dropped_all,
        "rollout/dynamic_sampling_short_groups": short,
    }
    return FilledBatch(groups, surplus, rejected, metrics)
