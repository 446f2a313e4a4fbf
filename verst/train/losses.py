"""The RL math of the trainer: advantages, KL penalties, the clipped policy loss, reductions.

Everything here is a pure function of tensors (no model, no optimizer), tested against closed
forms. Per-token tensors are `[B, T]` (sequences × response tokens) and come with a
`mask_B_T` of 1 for tokens the model generated and 0 for padding / tool output.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from verst.configbase import ConfigBase

KLType = Literal["k1", "k2", "k3", "low_var_kl"]
Aggregation = Literal["token_mean", "seq_mean"]

# exp() of a log-ratio beyond this overflows float32 to inf and poisons the gradient.
_LOG_RATIO_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


class LossConfig(ConfigBase):
    """How advantages are estimated and how the policy loss is built and reduced."""

    advantage_estimator: Literal["grpo"] = Field(
        "grpo", description="advantage estimator: grpo = reward minus group mean (÷ group std)"
    )
    grpo_std_normalization: bool = Field(
        True, description="divide GRPO advantages by the group std; false = Dr.GRPO"
    )
    eps_clip: float = Field(
        0.2, gt=0, lt=1, description="PPO clip range below 1: ratio >= 1 - eps_clip"
    )
    eps_clip_high: float | None = Field(
        None, gt=0, description="PPO clip range above 1 (DAPO clip-higher); None = eps_clip"
    )
    loss_aggregation: Aggregation = Field(
        "token_mean",
        description="token_mean: mean over all tokens (DAPO); seq_mean: mean of sequence means",
    )
    kl_loss_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the KL loss to the reference (the policy as RL starts)",
    )
    kl_loss_type: KLType = Field("k3", description="KL estimator: k1 | k2 | k3 | low_var_kl")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus (subtracted)")

    @property
    def clip_high(self) -> float:
        """The effective upper clip range (eps_clip_high, or eps_clip when unset)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_reference_model(self) -> bool:
        """Whether the trainer must keep a frozen reference model."""
        return self.kl_loss_coef > 0.0


def grpo_advantages(rewards_P_G: Tensor, *, std_normalization: bool, eps: float = 1e-6) -> Tensor:
    """GRPO advantages for a full table of P prompts × G samples: (r − group mean) [/ (std + eps)].

    The std is the unbiased one (torch.std, divisor G − 1), as in Miles and verl. A group of
    one has advantage 0 (nothing to compare with), and so does a group of equal rewards; such
    groups are never divided, so they stay exactly 0 for any eps, including 0.
    """
    rewards_P_G = rewards_P_G.float()
    centered_P_G = rewards_P_G - rewards_P_G.mean(dim=-1, keepdim=True)
    if std_normalization and rewards_P_G.shape[-1] > 1:
        std_P_1 = rewards_P_G.std(dim=-1, keepdim=True)
        centered_P_G = torch.where(std_P_1 > 0, centered_P_G / (std_P_1 + eps), 0.0)
    return centered_P_G


def group_advantages(
    rewards_N: Tensor, group_ids_N: Tensor, *, std_normalization: bool, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages for a flat list of samples whose groups may differ in size.

    `group_ids_N` holds any integer id per sample; samples sharing an id form a group. The
    results equal `grpo_advantages` applied group by group (unbiased std; singletons → 0).
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


def kl_penalty(logprobs_B_T: Tensor, ref_logprobs_B_T: Tensor, kind: KLType) -> Tensor:
    """Per-token KL(policy ‖ reference) estimate from sampled-token log-probs (Schulman k1-k3)."""
    log_ratio_B_T = logprobs_B_T.float() - ref_logprobs_B_T.float()
    if kind == "k1":
        return log_ratio_B_T
    if kind == "k2":
        return 0.5 * log_ratio_B_T.square()
    if kind in ("k3", "low_var_kl"):
        neg_B_T = -log_ratio_B_T
        kl_B_T = torch.expm1(neg_B_T) - neg_B_T
        if kind == "low_var_kl":
            kl_B_T = kl_B_T.clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
        return kl_B_T
    raise ValueError(f"unknown kl_loss_type {kind!r}")


def policy_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token: max(−A·ratio, −A·clip(ratio, 1−eps, 1+eps_high)).

    Returns `(loss_B_T, clipped_B_T)`, where clipped is 1.0 where the clipped branch is
    strictly larger (no gradient flows through that token).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio_B_T = (logprobs_B_T - old_logprobs_B_T).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio_B_T = torch.exp(log_ratio_B_T)
    unclipped_B_T = -advantages_B_T * ratio_B_T
    clipped_B_T = -advantages_B_T * ratio_B_T.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss_B_T = torch.maximum(unclipped_B_T, clipped_B_T)
    return loss_B_T, (clipped_B_T > unclipped_B_T).float()


def aggregate(
    values_B_T: Tensor,
    mask_B_T: Tensor,
    mode: Aggregation,
    *,
    token_normaliser: float | None = None,
    num_sequences: float | None = None,
) -> Tensor:
    """Reduce per-token values to a scalar loss.

    token_mean: Σ values·mask / (token_normaliser or Σ mask).
    seq_mean: Σ_b [Σ_t values·mask / max(Σ_t mask, 1)] / (num_sequences or B).
    Pass the global token / sequence count when a batch is split into micro-batches: the sum
    of the micro-batch results then equals the full-batch value exactly. Denominators are
    clamped to at least 1 and masked positions are zeroed with `where`, so empty responses
    and NaN/inf in padding give 0, never NaN.
    """
    mask_B_T = mask_B_T.to(values_B_T.dtype)
    masked_B_T = torch.where(mask_B_T > 0, values_B_T * mask_B_T, torch.zeros_like(values_B_T))
    if mode == "token_mean":
        if token_normaliser is None:
            return masked_B_T.sum() / mask_B_T.sum().clamp(min=1.0)
        return masked_B_T.sum() / max(token_normaliser, 1.0)
    if mode == "seq_mean":
        per_seq_B = masked_B_T.sum(dim=-1) / mask_B_T.sum(dim=-1).clamp(min=1.0)
        n = values_B_T.shape[0] if num_sequences is None else num_sequences
        return per_seq_B.sum() / max(n, 1.0)
    raise ValueError(f"unknown loss_aggregation {mode!r}")


def logprobs_from_logits(
    logits_B_T_V: Tensor, tokens_B_T: Tensor, temperature: float = 1.0
) -> Tensor:
    """float32 log-probability of `tokens_B_T` under softmax(logits / temperature).

    Computed as logit[token] − logsumexp(logits) so no [B, T, V] log-softmax is kept around.
    """
    logits_B_T_V = logits_B_T_V.float()
    if temperature != 1.0:
        logits_B_T_V = logits_B_T_V / temperature
    picked_B_T = logits_B_T_V.gather(-1, tokens_B_T.long().unsqueeze(-1)).squeeze(-1)
    return picked_B_T - torch.logsumexp(logits_B_T_V, dim=-1)


def entropy_from_logits(logits_B_T_V: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position, in nats, computed in float32."""
    logits_B_T_V = logits_B_T_V.float()
    probs_B_T_V = torch.softmax(logits_B_T_V, dim=-1)
    # H = logsumexp(z) − Σ p·z; where() keeps −inf logits (masked vocab) from giving 0·−inf = NaN.
    p_z_B_T_V = torch.where(probs_B_T_V > 0, probs_B_T_V * logits_B_T_V, 0.0)
    return torch.logsumexp(logits_B_T_V, dim=-1) - p_z_B_T_V.sum(dim=-1)
