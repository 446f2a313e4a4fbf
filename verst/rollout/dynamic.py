"""DAPO dynamic sampling: keep only groups whose rewards differ, sampling more to fill the batch.

A group whose samples all got the same reward has advantage 0 everywhere under GRPO, so it
adds no signal and only dilutes the batch. With dynamic sampling on, the rollout draws rounds
of `prompts_per_step` prompts until enough informative groups are kept (counted over all
ranks) or `max_sampling_rounds` is reached; a short batch then trains on what it has. Every
rank runs the same number of rounds, so the ranks' data sources stay in step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verst import distributed
from verst.types import Group


def has_reward_variance(group: Group) -> bool:
    rewards = torch.tensor([s.reward or 0.0 for s in group], dtype=torch.float64)
    return len(group) > 1 and float(rewards.std()) > 1e-8


def fill_batch(
    draw: Callable[[], list[Group]],
    target_groups: int,
    *,
    max_rounds: int,
    device: torch.device,
) -> tuple[list[Group], dict[str, float]]:
    """Rounds of `draw()` (this rank's share of one step's groups, generated and scored) until
    `target_groups` informative groups are kept over all ranks."""
    kept: list[Group] = []
    last: list[Group] = []
    dropped = rounds = 0
    while True:
        rounds += 1
        last = draw()
        informative = [g for g in last if has_reward_variance(g)]
        kept += informative
        dropped += len(last) - len(informative)
        kept_all = distributed.all_reduce_sum([float(len(kept))], device)[0]
        if kept_all >= target_groups or rounds >= max_rounds:
            break
    share = -(-target_groups // distributed.world_size())  # ceil: this rank's part
    dropped_all, short = distributed.all_reduce_sum(
        [float(dropped), float(max(target_groups - kept_all, 0.0))], device
    )
    # A rank left with nothing trains on its last draw: zero advantages, so no policy
    # gradient, but every rank still takes part in the step's collectives.
    groups = kept[:share] or last
    return groups, {
        "rollout/dynamic_sampling_rounds": float(rounds),
        "rollout/dynamic_sampling_dropped_groups": dropped_all,
        "rollout/dynamic_sampling_short_groups": short,
    }
