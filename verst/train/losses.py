"""The RL math of the trainer: KL penalties, the policy and value losses, reductions, and
log-probs and entropy from logits.

Everything here is a pure function of tensors (no model, no optimizer, no config), tested
against closed forms; `verst.train.algorithms` names the policy losses built from it and holds
the loss config. Per-token tensors are `[B, T]` (sequences × response tokens, see
`verst.types`) and come with a `mask_B_T` of 1 for tokens the model generated and 0 for
padding / tool output.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLType = Literal["k1", "k2", "k3", "low_var_kl"]
Aggregation = Literal["token_mean", "seq_mean", "constant"]

# exp() of a log-ratio beyond this overflows float32 to inf and poisons the gradient.
_LOG_RATIO_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


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


def policy_loss_from_log_ratio(
    log_ratio_B_T: Tensor,
    advantages_B_T: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token from log(ratio): max(−A·r, −A·clip(r, 1−eps, 1+eps_high)).

    With `eps_clip_c` (dual-clip PPO, Ye et al. 2020), tokens with A < 0 are further capped at
    −A·eps_clip_c, so a huge ratio on a bad token cannot blow the loss up. Returns
    `(loss_B_T, clipped_B_T)`, where clipped is 1.0 where a clip is active, i.e. where no
    gradient flows through that token (the PPO clip strictly above the unclipped branch, or the
    dual clip strictly below the PPO loss).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio_B_T = torch.exp(log_ratio_B_T.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    unclipped_B_T = -advantages_B_T * ratio_B_T
    clipped_B_T = -advantages_B_T * ratio_B_T.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss_B_T = torch.maximum(unclipped_B_T, clipped_B_T)
    is_clipped_B_T = clipped_B_T > unclipped_B_T
    if eps_clip_c is not None:
        dual_B_T = -advantages_B_T * eps_clip_c
        is_dual_B_T = (advantages_B_T < 0) & (dual_B_T < loss_B_T)
        loss_B_T = torch.where(is_dual_B_T, dual_B_T, loss_B_T)
        is_clipped_B_T = is_clipped_B_T | is_dual_B_T
    return loss_B_T, is_clipped_B_T.float()


def gspo_log_ratio(logprobs_B_T: Tensor, old_logprobs_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """GSPO's sequence log-ratio, mean_t (logp − old) over masked-in tokens, on every token.

    Written in GSPO's token-level form, sg[log s] + logp_t − sg[logp_t]: the value on every
    token is log s of its sequence, and d/d logp_t is s (through exp) — so with a sequence-wide
    advantage and seq_mean aggregation the gradient is exactly GSPO's
    s·A·(1/|y|)·Σ_t ∇logp_t, and clipping acts on the sequence ratio. Empty rows give 0.
    """
    mask_B_T = mask_B_T > 0
    diff_B_T = torch.where(mask_B_T, logprobs_B_T - old_logprobs_B_T, 0.0)
    seq_mean_B_1 = diff_B_T.sum(-1, keepdim=True) / mask_B_T.sum(-1, keepdim=True).clamp(min=1)
    # where(): padding log-probs may be −inf, and −inf − (−inf) would put NaN in the values.
    identity_B_T = torch.where(mask_B_T, logprobs_B_T - logprobs_B_T.detach(), 0.0)
    return seq_mean_B_1.detach() + identity_B_T


def value_loss(
    values_B_T: Tensor, old_values_B_T: Tensor, returns_B_T: Tensor, *, value_clip: float
) -> Tensor:
    """Clipped critic loss per token: 0.5·max((v − R)², (clip(v, old ± value_clip) − R)²)."""
    clipped_B_T = old_values_B_T + (values_B_T - old_values_B_T).clamp(-value_clip, value_clip)
    return 0.5 * torch.maximum(
        (values_B_T - returns_B_T).square(), (clipped_B_T - returns_B_T).square()
    )


def aggregate(
    values_B_T: Tensor,
    mask_B_T: Tensor,
    mode: Aggregation,
    *,
    token_normaliser: float | None = None,
    num_sequences: float | None = None,
    constant_normaliser: float | None = None,
) -> Tensor:
    """Reduce per-token values to a scalar loss.

    token_mean: Σ values·mask / (token_normaliser or Σ mask).
    seq_mean: Σ_b [Σ_t values·mask / max(Σ_t mask, 1)] / (num_sequences or B).
    constant: Σ values·mask / (constant_normaliser · (num_sequences or B)) — Dr.GRPO's
    length-independent divisor (constant_normaliser is typically max_new_tokens).
    Pass the global token / sequence count when a batch is split into micro-batches: the sum
    of the micro-batch results then equals the full-batch value exactly. Denominators are
    clamped to at least 1 and masked positions are zeroed with `where`, so empty responses
    and NaN/inf in padding give 0, never NaN.
    """
    mask_B_T = mask_B_T.to(values_B_T.dtype)
    masked_B_T = torch.where(mask_B_T > 0, values_B_T * mask_B_T, torch.zeros_like(values_B_T))
    n = values_B_T.shape[0] if num_sequences is None else num_sequences
    if mode == "token_mean":
        if token_normaliser is None:
            return masked_B_T.sum() / mask_B_T.sum().clamp(min=1.0)
        return masked_B_T.sum() / max(token_normaliser, 1.0)
    if mode == "seq_mean":
        per_seq_B = masked_B_T.sum(dim=-1) / mask_B_T.sum(dim=-1).clamp(min=1.0)
        return per_seq_B.sum() / max(n, 1.0)
    if mode == "constant":
        if constant_normaliser is None or constant_normaliser <= 0:
            raise ValueError("aggregate(mode='constant') needs a positive constant_normaliser")
        return masked_B_T.sum() / (constant_normaliser * max(n, 1.0))
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
