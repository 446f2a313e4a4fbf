"""The diffusion RL objectives in closed form: Flow-GRPO, DiffusionNFT, and the step strategies.

- `group_advantages`: (r - mean_group) / (std_group + 1e-4), clamped to +-adv_clip_max.
- `flow_grpo_loss`: PPO's clipped surrogate per transition, ratio = exp(logp_new - logp_old),
  plus beta_kl x mean((mu_new - mu_ref)^2) / (2 sigma^2) when a reference is given.
- `nft_loss` (DiffusionNFT): x_t = (1 - t) x0 + t eps; r = clamp((clamp(A) / c) / 2 + 1/2, 0, 1);
  v+ = beta v_new + (1 - beta) v_old, v- = (1 + beta) v_old - beta v_new; x0_hat = x_t - t v;
  loss = c [r |x0_hat+ - x0|^2 / w+ + (1 - r) |x0_hat- - x0|^2 / w-] / beta, where each w is the
  detached mean absolute error of its branch (DiffusionNFT's adaptive weighting).
- `sde_window` / `epoch_global_random_choice`: which steps of a trajectory train.
"""

from __future__ import annotations

from typing import Literal

import torch

StepStrategy = Literal["sde_window", "epoch_global_random_choice"]


def group_advantages(rewards_P_G: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """Group-normalised advantages, clamped to +-`adv_clip_max`."""
    mean = rewards_P_G.mean(dim=1, keepdim=True)
    std = rewards_P_G.std(dim=1, unbiased=False, keepdim=True)
    return ((rewards_P_G - mean) / (std + 1e-4)).clamp(-adv_clip_max, adv_clip_max)


def flow_grpo_loss(
    logp_new_N: torch.Tensor,
    logp_old_N: torch.Tensor,
    advantages_N: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean clipped surrogate over transitions (each row one x_t -> x_t' of one trajectory)."""
    ratio = torch.exp(logp_new_N - logp_old_N)
    unclipped = -advantages_N * ratio
    clipped = -advantages_N * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    clip_frac = ((ratio.detach() - 1).abs() > clip_range).float().mean()
    return loss, {
        "train/clip_frac": float(clip_frac),
        "train/ratio_mean": float(ratio.detach().mean()),
    }


def gaussian_mean_kl(mean_new_N: torch.Tensor, mean_ref_N: torch.Tensor, std_N: torch.Tensor):
    """Per-transition KL of two Gaussians of equal std: mean((mu_new - mu_ref)^2) / (2 sigma^2)."""
    sq = (mean_new_N - mean_ref_N).pow(2).flatten(1).mean(dim=1)
    return sq / (2 * std_N.pow(2))


def nft_r(advantages_N: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """The optimality probability r in [0, 1] from the clamped advantage."""
    clamped = advantages_N.clamp(-adv_clip_max, adv_clip_max)
    return ((clamped / adv_clip_max) / 2 + 0.5).clamp(0, 1)


def nft_branches(
    v_new: torch.Tensor, v_old: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(v+, v-): the implicit positive and negative policies around the old velocity."""
    return beta * v_new + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_new


def _weighted_error(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    dims = tuple(range(1, x0.dim()))
    with torch.no_grad():
        weight = (x0_hat - x0).abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
    return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t_N: torch.Tensor,
    v_new: torch.Tensor,
    v_old: torch.Tensor,
    advantages_N: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
) -> torch.Tensor:
    """DiffusionNFT's loss, averaged over the N corrupted samples (`x_t` = (1 - t) x0 + t eps)."""
    r = nft_r(advantages_N, adv_clip_max)
    v_pos, v_neg = nft_branches(v_new, v_old.detach(), beta)
    t = t_N.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    positive = _weighted_error(x_t - t * v_pos, x0)
    negative = _weighted_error(x_t - t * v_neg, x0)
    return (adv_clip_max * (r * positive + (1 - r) * negative) / beta).mean()


def sde_window(
    num_steps: int, window_size: int, window_range: tuple[int, int], seed: int
) -> list[int]:
    """A contiguous window of `window_size` steps whose start is drawn in `window_range`
    (inclusive start, exclusive end of the window) under `seed`."""
    low, high = window_range
    if not 0 <= low < high <= num_steps or high - low < window_size or window_size < 1:
        raise ValueError(
            f"diffusion.sde_window_range {list(window_range)} cannot hold a window of "
            f"{window_size} steps inside 0..{num_steps}"
        )
    generator = torch.Generator().manual_seed(seed)
    start = int(torch.randint(low, high - window_size + 1, (1,), generator=generator))
    return list(range(start, start + window_size))


def epoch_global_random_choice(
    num_steps: int, count: int, seed: int, epoch: int, *, allowed: list[int] | None = None
) -> list[int]:
    """`count` distinct steps (sorted) drawn from `allowed` (default all) under seed + epoch;
    every trajectory of the epoch trains the same steps."""
    pool = list(range(num_steps)) if allowed is None else allowed
    if not 1 <= count <= len(pool):
        raise ValueError(f"diffusion.train_steps_per_trajectory={count} must be in 1..{len(pool)}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    picks = torch.randperm(len(pool), generator=generator)[:count]
    return sorted(pool[int(i)] for i in picks)
