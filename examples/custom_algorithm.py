"""An example advantage estimator and policy loss, chosen by import path in the config:

    loss:
      advantage_estimator: examples.custom_algorithm:RLOO
      policy_loss: examples.custom_algorithm:unclipped_policy_gradient

An estimator is an object with the members of `verst.plugins.AdvantageEstimator`
(a class is instantiated without arguments); a policy loss is a callable with the signature of
`PolicyLoss`. Both are checked when the config loads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verst.plugins import TokenInputs
from verst.train.algorithms import LossConfig


class RLOO:
    """REINFORCE leave-one-out: each reward minus the mean reward of the *other* samples of
    its group, the same on every token. A group of one has advantage 0."""

    group_relative = True  # refused with rollout.n_samples_per_prompt < 2
    token_level = False  # one advantage per sample; no per-token pass, no KL as reward
    whiten_by_default = False
    needs_critic = False
    needs_reference = False
    default_policy_loss = "ppo_clip"

    def sequence_advantages(
        self, rewards_B: Tensor, group_ids_B: Tensor, cfg: LossConfig
    ) -> Tensor:
        rewards_B = rewards_B.float()
        _, group_B = torch.unique(group_ids_B, return_inverse=True)
        size_B = torch.bincount(group_B).float()[group_B]
        sum_B = torch.zeros_like(rewards_B).index_add(0, group_B, rewards_B)[group_B]
        others_mean_B = (sum_B - rewards_B) / (size_B - 1).clamp(min=1)
        return torch.where(size_B > 1, rewards_B - others_mean_B, 0.0)

    def token_advantages(
        self, inputs: TokenInputs, cfg: LossConfig
    ) -> tuple[Tensor, Tensor | None]:
        return inputs.sequence_advantages_B_T, None  # no critic, so no returns


def unclipped_policy_gradient(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    cfg: LossConfig,
) -> tuple[Tensor, Tensor]:
    """−A·ratio on every token, never clipped (the importance-weighted policy gradient)."""
    ratio_B_T = torch.exp((logprobs_B_T - old_logprobs_B_T).clamp(-20.0, 20.0))
    return -advantages_B_T * ratio_B_T, torch.zeros_like(ratio_B_T)
