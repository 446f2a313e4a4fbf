"""Rollout metrics of one step: reward, response length, truncation, zero-variance groups."""

from __future__ import annotations

import torch

from verst import distributed
from verst.types import Group, Status


def rollout_metrics(
    groups: list[Group], device: torch.device, counts: dict[str, float] | None = None
) -> dict[str, float]:
    """Means over every sample of every rank; `zero_std_ratio` is the share of groups whose
    rewards are all equal (they carry no GRPO signal). `counts` (the same keys on every rank)
    are summed over the ranks, in the same collective."""
    counts = counts or {}
    samples = [s for group in groups for s in group]
    rewards = [s.reward or 0.0 for s in samples]
    zero_std = sum(1 for g in groups if len({s.reward for s in g}) <= 1)
    totals = distributed.all_reduce_sum(
        [
            float(len(samples)),
            sum(rewards),
            float(sum(s.response_length for s in samples)),
            float(sum(s.status == Status.TRUNCATED for s in samples)),
            float(sum(s.status == Status.FAILED for s in samples)),
            float(sum(s.status == Status.ABORTED for s in samples)),
            float(zero_std),
            float(len(groups)),
            *counts.values(),
        ],
        device,
    )
    n, reward, length, truncated, failed, aborted, zero, num_groups = totals[:8]
    n = max(n, 1.0)
    return dict(zip(counts, totals[8:], strict=True)) | {
        "rollout/reward_mean": reward / n,
        "rollout/response_len_mean": length / n,
        "rollout/response_tokens": length,
        "rollout/truncated_ratio": truncated / n,
        "rollout/failed_ratio": failed / n,
        "rollout/aborted_ratio": aborted / n,
        "rollout/zero_std_ratio": zero / max(num_groups, 1.0),
        "rollout/num_samples": n,
    }
