"""The math of the advantage estimators: group-relative advantages, token rewards, discounted
returns (REINFORCE++), GAE, and whitening over the batch.

Everything here is a pure function of tensors (whitening also sums over ranks, when there are
several), tested against closed forms; the estimators built from it live in
`verst.train.algorithms`. Scalar rewards are `rewards_N` (one per sequence); per-token tensors
are `[N, T]` (sequences × response tokens) with a `mask_N_T` of 1 for tokens the model
generated and 0 for padding / tool output. Per-token outputs are 0 at masked positions.
Recurrences over time (discounted returns, GAE) run over the masked-in tokens only: a masked
position neither adds reward nor breaks or discounts the chain, so a tool-output gap inside a
response is invisible to the discounting.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verst import distributed


def group_advantages(
    rewards_N: Tensor, group_ids_N: Tensor, *, std_normalization: bool, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages for a flat list of samples whose groups may differ in size:
    (r − group mean), divided by (group std + eps) with `std_normalization`.

    `group_ids_N` holds any integer id per sample; samples sharing an id form a group. The std
    is the unbiased one (torch.std, divisor G − 1), as in Miles and verl. A group of one has
    advantage 0 (nothing to compare with), and so does a group of equal rewards; such groups
    are never divided, so they stay exactly 0 for any eps, including 0.
    """
    rewards_N = rewards_N.float()
    _, inverse_N = torch.unique(group_ids_N, return_inverse=True)
    num_groups = int(inverse_N.max().item()) + 1 if inverse_N.numel() else 0
    zeros_K = rewards_N.new_zeros(num_groups)
    counts_K = zeros_K.index_add(0, inverse_N, torch.ones_like(rewards_N))
    sums_K = zeros_K.index_add(0, inverse_N, rewards_N)
    mean_N = (sums_K / counts_K)[inverse_N]
    centered_N = rewards_N - mean_N
    if not std_normalization:
        return centered_N
    sq_K = zeros_K.index_add(0, inverse_N, centered_N.square())
    std_N = (sq_K / (counts_K - 1).clamp(min=1)).sqrt()[inverse_N]
    return torch.where(std_N > 0, centered_N / (std_N + eps), 0.0)


def terminal_token_rewards(rewards_N: Tensor, mask_N_T: Tensor) -> Tensor:
    """Each sequence's scalar reward placed on its last masked-in token; 0 elsewhere.

    An empty response (no masked-in token) gets all zeros: its reward has nowhere to go.
    """
    mask_N_T = mask_N_T > 0
    rewards_N_T = torch.zeros(mask_N_T.shape, dtype=torch.float32, device=mask_N_T.device)
    if mask_N_T.shape[-1] == 0:
        return rewards_N_T
    positions_T = torch.arange(1, mask_N_T.shape[-1] + 1, device=mask_N_T.device)
    # 1-based index of the last masked-in token, 0 for an empty row.
    last_N_1 = (mask_N_T * positions_T).amax(dim=-1, keepdim=True)
    is_last_N_T = (positions_T == last_N_1) & (last_N_1 > 0)
    return torch.where(is_last_N_T, rewards_N.float().unsqueeze(-1), rewards_N_T)


def discounted_returns(token_rewards_N_T: Tensor, mask_N_T: Tensor, gamma: float) -> Tensor:
    """Reward-to-go G_t = Σ_{s ≥ t} γ^k(s, t) r_s over the masked-in tokens of each sequence.

    k(s, t) counts masked-in tokens strictly between t and s plus one, i.e. the discount chain
    skips masked positions, whose rewards are ignored. Masked positions return 0.
    """
    mask_N_T = mask_N_T > 0
    rewards_N_T = torch.where(mask_N_T, token_rewards_N_T.float(), 0.0)
    if gamma == 1.0:
        # Undiscounted: a reverse cumulative sum, no Python loop over time.
        returns_N_T = rewards_N_T.flip(-1).cumsum(-1).flip(-1)
        return torch.where(mask_N_T, returns_N_T, 0.0)
    returns_N_T = torch.zeros_like(rewards_N_T)
    running_N = rewards_N_T.new_zeros(rewards_N_T.shape[0])
    for t in reversed(range(rewards_N_T.shape[-1])):
        running_N = torch.where(mask_N_T[:, t], rewards_N_T[:, t] + gamma * running_N, running_N)
        returns_N_T[:, t] = running_N
    return torch.where(mask_N_T, returns_N_T, 0.0)


def reinforce_plus_plus_advantages(
    rewards_N: Tensor, kl_N_T: Tensor, mask_N_T: Tensor, *, kl_coef: float, gamma: float
) -> Tensor:
    """REINFORCE++: discounted returns of the token rewards −kl_coef·KL_t + r·[t is last].

    Whitening across the batch (`masked_whiten`) is the trainer's step, as in Miles.
    """
    token_rewards_N_T = terminal_token_rewards(rewards_N, mask_N_T) - kl_coef * kl_N_T.float()
    return discounted_returns(token_rewards_N_T, mask_N_T, gamma)


def gae(
    token_rewards_N_T: Tensor,
    values_N_T: Tensor,
    mask_N_T: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the masked-in tokens; returns (advantages, returns).

    δ_t = r_t + γ·V_next − V_t and A_t = δ_t + γλ·A_next, where "next" is the next masked-in
    token and the value after the last one is 0 (the episode ends with the response).
    returns = advantages + values. Both are 0 at masked positions.
    """
    mask_N_T = mask_N_T > 0
    rewards_N_T = token_rewards_N_T.float()
    values_N_T = values_N_T.float()
    advantages_N_T = torch.zeros_like(rewards_N_T)
    next_value_N = rewards_N_T.new_zeros(rewards_N_T.shape[0])
    next_adv_N = rewards_N_T.new_zeros(rewards_N_T.shape[0])
    for t in reversed(range(rewards_N_T.shape[-1])):
        m_N = mask_N_T[:, t]
        delta_N = rewards_N_T[:, t] + gamma * next_value_N - values_N_T[:, t]
        next_adv_N = torch.where(m_N, delta_N + gamma * lam * next_adv_N, next_adv_N)
        next_value_N = torch.where(m_N, values_N_T[:, t], next_value_N)
        advantages_N_T[:, t] = next_adv_N
    advantages_N_T = torch.where(mask_N_T, advantages_N_T, 0.0)
    returns_N_T = torch.where(mask_N_T, advantages_N_T + values_N_T, 0.0)
    return advantages_N_T, returns_N_T


def masked_whiten(
    advantages: list[Tensor], masks: list[Tensor], device: torch.device
) -> list[Tensor]:
    """(A − mean) / (std + 1e-8) over the masked-in entries of every [B, T] micro-batch on
    every rank together; masked → 0.

    One all-reduce of three sums serves the whole step, so the result equals whitening the
    global batch at once. The std is unbiased (divisor n − 1, as Miles' whitening applies
    Bessel's correction); fewer than two entries leave nothing to scale by, so it is 0 there.
    """
    sums = [0.0, 0.0, 0.0]
    for advantages_B_T, mask_B_T in zip(advantages, masks, strict=True):
        sums[0] += float((advantages_B_T * mask_B_T).sum())
        sums[1] += float((advantages_B_T.square() * mask_B_T).sum())
        sums[2] += float(mask_B_T.sum())
    total, total_sq, count = distributed.all_reduce_sum(sums, device)
    mean = total / max(count, 1.0)
    var = max(total_sq - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
    return [
        (advantages_B_T - mean) / (var**0.5 + 1e-8) * mask_B_T
        for advantages_B_T, mask_B_T in zip(advantages, masks, strict=True)
    ]
