"""The math of the advantage estimators: group-relative advantages, token rewards, discounted
returns (REINFORCE++), GAE, and whitening over the batch.

Everything here is a pure function of tensors (whitening also sums over ranks, when there are
several), tested against closed forms; the estimators built from it live in
`verst.train.algorithms`. Scalar rewards are `rewards_B` (one per sequence); per-token tensors
are `[B, T]` (sequences × response tokens, see `verst.types`) with a `mask_B_T` of 1 for
tokens the model generated and 0 for padding / tool output. Per-token outputs are 0 at masked
positions. Recurrences over time (discounted returns, GAE) run over the masked-in tokens only:
a masked position neither adds reward nor breaks or discounts the chain, so a tool-output gap
inside a response is invisible to the discounting.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from verst import distributed


def group_advantages(
    rewards_B: Tensor, group_ids_B: Tensor, *, std_normalization: bool, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages for a flat list of samples whose groups may differ in size:
    (r − group mean), divided by (group std + eps) with `std_normalization`.

    `group_ids_B` holds any integer id per sample; samples sharing an id form a group. The std
    is the unbiased one (torch.std, divisor G − 1), as in Miles and verl. A group of one has
    advantage 0 (nothing to compare with), and so does a group of equal rewards; such groups
    are never divided, so they stay exactly 0 for any eps, including 0.
    """
    rewards_B = rewards_B.float()
    _, inverse_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(inverse_B.max().item()) + 1 if inverse_B.numel() else 0
    zeros_K = rewards_B.new_zeros(num_groups)
    counts_K = zeros_K.index_add(0, inverse_B, torch.ones_like(rewards_B))
    sums_K = zeros_K.index_add(0, inverse_B, rewards_B)
    mean_B = (sums_K / counts_K)[inverse_B]
    centered_B = rewards_B - mean_B
    if not std_normalization:
        return centered_B
    sq_K = zeros_K.index_add(0, inverse_B, centered_B.square())
    std_B = (sq_K / (counts_K - 1).clamp(min=1)).sqrt()[inverse_B]
    return torch.where(std_B > 0, centered_B / (std_B + eps), 0.0)


def terminal_token_rewards(rewards_B: Tensor, mask_B_T: Tensor) -> Tensor:
    """Each sequence's scalar reward placed on its last masked-in token; 0 elsewhere.

    An empty response (no masked-in token) gets all zeros: its reward has nowhere to go.
    """
    mask_B_T = mask_B_T > 0
    rewards_B_T = torch.zeros(mask_B_T.shape, dtype=torch.float32, device=mask_B_T.device)
    if mask_B_T.shape[-1] == 0:
        return rewards_B_T
    positions_T = torch.arange(1, mask_B_T.shape[-1] + 1, device=mask_B_T.device)
    # 1-based index of the last masked-in token, 0 for an empty row.
    last_B_1 = (mask_B_T * positions_T).amax(dim=-1, keepdim=True)
    is_last_B_T = (positions_T == last_B_1) & (last_B_1 > 0)
    return torch.where(is_last_B_T, rewards_B.float().unsqueeze(-1), rewards_B_T)


def discounted_returns(token_rewards_B_T: Tensor, mask_B_T: Tensor, gamma: float) -> Tensor:
    """Reward-to-go G_t = Σ_{s ≥ t} γ^k(s, t) r_s over the masked-in tokens of each sequence.

    k(s, t) counts masked-in tokens strictly between t and s plus one, i.e. the discount chain
    skips masked positions, whose rewards are ignored. Masked positions return 0.
    """
    mask_B_T = mask_B_T > 0
    rewards_B_T = torch.where(mask_B_T, token_rewards_B_T.float(), 0.0)
    if gamma == 1.0:
        # Undiscounted: a reverse cumulative sum, no Python loop over time.
        returns_B_T = rewards_B_T.flip(-1).cumsum(-1).flip(-1)
        return torch.where(mask_B_T, returns_B_T, 0.0)
    returns_B_T = torch.zeros_like(rewards_B_T)
    running_B = rewards_B_T.new_zeros(rewards_B_T.shape[0])
    for t in reversed(range(rewards_B_T.shape[-1])):
        running_B = torch.where(mask_B_T[:, t], rewards_B_T[:, t] + gamma * running_B, running_B)
        returns_B_T[:, t] = running_B
    return torch.where(mask_B_T, returns_B_T, 0.0)


def reinforce_plus_plus_advantages(
    rewards_B: Tensor, kl_B_T: Tensor, mask_B_T: Tensor, *, kl_coef: float, gamma: float
) -> Tensor:
    """REINFORCE++: discounted returns of the token rewards −kl_coef·KL_t + r·[t is last].

    Whitening across the batch (`masked_whiten`) is the trainer's step, as in Miles.
    """
    token_rewards_B_T = terminal_token_rewards(rewards_B, mask_B_T) - kl_coef * kl_B_T.float()
    return discounted_returns(token_rewards_B_T, mask_B_T, gamma)


def gae(
    token_rewards_B_T: Tensor,
    values_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the masked-in tokens; returns (advantages, returns).

    δ_t = r_t + γ·V_next − V_t and A_t = δ_t + γλ·A_next, where "next" is the next masked-in
    token and the value after the last one is 0 (the episode ends with the response).
    returns = advantages + values. Both are 0 at masked positions.
    """
    mask_B_T = mask_B_T > 0
    rewards_B_T = token_rewards_B_T.float()
    values_B_T = values_B_T.float()
    advantages_B_T = torch.zeros_like(rewards_B_T)
    next_value_B = rewards_B_T.new_zeros(rewards_B_T.shape[0])
    next_adv_B = rewards_B_T.new_zeros(rewards_B_T.shape[0])
    for t in reversed(range(rewards_B_T.shape[-1])):
        m_B = mask_B_T[:, t]
        delta_B = rewards_B_T[:, t] + gamma * next_value_B - values_B_T[:, t]
        next_adv_B = torch.where(m_B, delta_B + gamma * lam * next_adv_B, next_adv_B)
        next_value_B = torch.where(m_B, values_B_T[:, t], next_value_B)
        advantages_B_T[:, t] = next_adv_B
    advantages_B_T = torch.where(mask_B_T, advantages_B_T, 0.0)
    returns_B_T = torch.where(mask_B_T, advantages_B_T + values_B_T, 0.0)
    return advantages_B_T, returns_B_T


def masked_whiten(
    advantages: list[Tensor], masks: list[Tensor], device: torch.device, group: Any = None
) -> list[Tensor]:
    """(A − mean) / (std + 1e-8) over the masked-in entries of every [B, T] micro-batch on
    every rank (of `group`, when given) together; masked → 0.

    One all-reduce of three sums serves the whole step, so the result equals whitening the
    global batch at once. The std is unbiased (divisor n − 1, as Miles' whitening applies
    Bessel's correction); fewer than two entries leave nothing to scale by, so it is 0 there.
    """
    sums = [0.0, 0.0, 0.0]
    for advantages_B_T, mask_B_T in zip(advantages, masks, strict=True):
        sums[0] += float((advantages_B_T * mask_B_T).sum())
        sums[1] += float((advantages_B_T.square() * mask_B_T).sum())
        sums[2] += float(mask_B_T.sum())
    total, total_sq, count = distributed.all_reduce_sum(sums, device, group)
    mean = total / max(count, 1.0)
    var = max(total_sq - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
    return [
        (advantages_B_T - mean) / (var**0.5 + 1e-8) * mask_B_T
        for advantages_B_T, mask_B_T in zip(advantages, masks, strict=True)
    ]


def opd_advantages(
    advantages_B_T: Tensor,
    student_logprobs_B_T: Tensor,
    teacher_logprobs_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    coef: float,
) -> Tensor:
    """On-policy distillation: A_t − coef·(log π_student(y_t) − log π_teacher(y_t)), 0 where
    masked.

    The student's log-prob is the one it sampled the token with (the rollout's), so the
    penalty is a per-token sample of the reverse KL(student ‖ teacher): tokens the teacher
    finds less likely than the student did are pushed down, likelier ones pulled up.
    """
    penalty_B_T = student_logprobs_B_T.float() - teacher_logprobs_B_T.float()
    return (advantages_B_T - coef * penalty_B_T) * mask_B_T
