"""Group filters (`rollout.filter`) and drawing until the batch is full (DAPO dynamic sampling).

A filter (`verst.plugins.SampleFilter`) returns None to keep a scored group, or the reason to
drop it. The built-in `reward_variance` (what `rollout.dynamic_sampling: true` means) drops a
group whose samples all got the same reward: under GRPO its advantage is 0 everywhere, so it
adds no signal and only dilutes the batch.

With a filter, the synchronous rollout draws rounds of `prompts_per_step` prompts until enough
groups are kept (counted over all ranks) or `max_sampling_rounds` is reached; a short batch
then trains on what it has. Every rank runs the same number of rounds, so the ranks' data
sources stay in step. Kept groups beyond this rank's share of the batch are not thrown away:
`fill_batch` returns them as `surplus`, and the rollout gives their prompts back to be served
again. (The fully asynchronous worker filters each group before it enters the buffer.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verst import distributed
from verst.plugin_loader import load_named
from verst.plugins import SampleFilter
from verst.rollout.ledger import NO_VARIANCE
from verst.types import Group

FILTER_FIELD = "rollout.filter"


def has_reward_variance(group: Group) -> bool:
    """Whether the rewards of the group's scored samples (neither ABORTED nor FAILED: those are
    not trained on) differ."""
    rewards = torch.tensor([s.reward or 0.0 for s in group if s.scored], dtype=torch.float64)
    return len(rewards) > 1 and float(rewards.std()) > 1e-8


def reward_variance(group: Group) -> str | None:
    """The built-in filter `reward_variance`: drops a group whose scored samples' rewards are
    all equal ("no reward variance")."""
    return None if has_reward_variance(group) else NO_VARIANCE


BUILTIN_FILTERS: dict[str, SampleFilter] = {"reward_variance": reward_variance}


def load_filter(path: str) -> SampleFilter:
    """A built-in filter by bare name, or any 'pkg.mod:fn' that takes a group; `PluginError`
    naming `rollout.filter` otherwise."""
    return load_named(path, BUILTIN_FILTERS, SampleFilter, field=FILTER_FIELD, kind="filter")


def drop_reason(keep: SampleFilter, group: Group) -> str | None:
    """What `keep` says of `group`: None, or its reason to drop it; `TypeError` naming
    `rollout.filter` when it returns something else (a bool, say)."""
    verdict = keep(group)
    if verdict is None or (isinstance(verdict, str) and verdict):
        return verdict
    raise TypeError(
        f"{FILTER_FIELD} returned {verdict!r}: a filter returns None to keep a group, or a "
        "non-empty reason (str) to drop it"
    )


@dataclass
class FilledBatch:
    """What `fill_batch` drew: the `groups` to train on, kept `surplus` beyond this rank's
    share, the `rejected` groups with the filter's reasons, and `rollout/dynamic_sampling_*`
    metrics."""

    groups: list[Group]
    surplus: list[Group]
    rejected: list[tuple[Group, str]]
    metrics: dict[str, float]


def fill_batch(
    draw: Callable[[], list[Group]],
    target_groups: int,
    *,
    max_rounds: int,
    device: torch.device,
    keep: SampleFilter = reward_variance,
) -> FilledBatch:
    """Rounds of `draw()` (this rank's share of one step's groups, generated and scored) until
    `target_groups` groups that `keep` keeps are there over all ranks."""
    kept: list[Group] = []
    rejected: list[tuple[Group, str]] = []
    last: list[Group] = []
    rounds = 0
    while True:
        rounds += 1
        last = draw()
        for group in last:
            reason = drop_reason(keep, group)
            if reason is None:
                kept.append(group)
            else:
                rejected.append((group, reason))
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
        rejected = [(g, r) for g, r in rejected if not any(g is chosen for chosen in last)]
    metrics = {
        "rollout/dynamic_sampling_rounds": float(rounds),
        "rollout/dynamic_sampling_dropped_groups": dropped_all,
        "rollout/dynamic_sampling_short_groups": short,
    }
    return FilledBatch(groups, surplus, rejected, metrics)
