"""Train–inference mismatch: importance weights of the trainer's over the engine's log-probs.

The engine samples with its own kernels and precision, so its log-probs (`rollout_logprobs`)
differ from the trainer's recompute (`train_logprobs`) of the same tokens. TIS (truncated
importance sampling) multiplies each token's loss by w = exp(train − rollout) clamped to
[low, high]; MIS (masked importance sampling) computes w per token, per sequence or as a
per-sequence geometric mean, and truncates or masks it. Weights carry no gradient and are 0
at masked positions. Metrics are masked means over tokens, returned as floats: pass
`token_normaliser` (the global masked-token count) to get a micro-batch's share instead, so
shares add up to the batch value.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

# exp() of a log-ratio beyond this overflows float32; a weight of e^20 is already absurd.
_LOG_RATIO_CLAMP = 20.0


def _masked_mean(x_B_T: Tensor, mask_B_T: Tensor, token_normaliser: float | None) -> float:
    total = torch.where(mask_B_T, x_B_T, 0.0).sum()
    denom = mask_B_T.sum().clamp(min=1) if token_normaliser is None else max(token_normaliser, 1.0)
    return float(total / denom)


def _log_ratio(
    train_logprobs_B_T: Tensor, rollout_logprobs_B_T: Tensor, mask_B_T: Tensor
) -> Tensor:
    # Masked positions may hold −inf or garbage; they are zeroed before any sum or exp.
    diff_B_T = train_logprobs_B_T.detach().float() - rollout_logprobs_B_T.detach().float()
    return torch.where(mask_B_T, diff_B_T, 0.0)


def tis_weights(
    train_logprobs_B_T: Tensor,
    rollout_logprobs_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    low: float,
    high: float,
    token_normaliser: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token TIS weights clamp(exp(train − rollout), low, high), and their metrics.

    Metrics (as Miles logs them): `tis_mean` = mean raw ratio, `tis_abs` = mean |raw − 1|
    (both measure the mismatch, before the clamp), `tis_clipfrac` = share of tokens clamped.
    """
    mask_B_T = mask_B_T > 0
    log_w_B_T = _log_ratio(train_logprobs_B_T, rollout_logprobs_B_T, mask_B_T)
    raw_B_T = torch.exp(log_w_B_T.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    weights_B_T = torch.where(mask_B_T, raw_B_T.clamp(low, high), 0.0)
    outside_B_T = ((raw_B_T < low) | (raw_B_T > high)).float()
    metrics = {
        "tis_mean": _masked_mean(raw_B_T, mask_B_T, token_normaliser),
        "tis_clipfrac": _masked_mean(outside_B_T, mask_B_T, token_normaliser),
        "tis_abs": _masked_mean((raw_B_T - 1).abs(), mask_B_T, token_normaliser),
    }
    return weights_B_T, metrics


def mis_weights(
    train_logprobs_B_T: Tensor,
    rollout_logprobs_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    level: Literal["token", "sequence", "geometric"],
    mode: Literal["truncate", "mask"],
    low: float,
    high: float,
    token_normaliser: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """MIS weights at one level, truncated or masked, and their metrics.

    level token: w_t = exp(train_t − rollout_t); sequence: exp(Σ_t masked log-ratio), the
    sequence's full likelihood ratio, on each of its tokens; geometric: exp(mean_t masked
    log-ratio), its per-token geometric mean. An empty sequence has ratio 1.
    mode truncate: clamp(w, low, high). mode mask: 0 where w is outside [low, high] (at token
    level that token, otherwise every token of the sequence), else w itself — the kept tokens
    are still importance-weighted, masking only rejects the outliers.
    Metrics: `mis_mean` and `mis_abs` (mean raw w and |raw w − 1|), `mis_clipfrac` (share of
    tokens whose w is outside [low, high]), `mis_masked_frac` (share zeroed; 0 for truncate).
    """
    mask_B_T = mask_B_T > 0
    log_w_B_T = _log_ratio(train_logprobs_B_T, rollout_logprobs_B_T, mask_B_T)
    if level == "sequence":
        log_w_B_T = log_w_B_T.sum(-1, keepdim=True).expand_as(log_w_B_T)
    elif level == "geometric":
        counts_B_1 = mask_B_T.sum(-1, keepdim=True).clamp(min=1)
        log_w_B_T = (log_w_B_T.sum(-1, keepdim=True) / counts_B_1).expand_as(log_w_B_T)
    elif level != "token":
        raise ValueError(f"unknown mis_level {level!r}")
    raw_B_T = torch.exp(log_w_B_T.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    outside_B_T = (raw_B_T < low) | (raw_B_T > high)
    if mode == "truncate":
        weights_B_T = raw_B_T.clamp(low, high)
        zeroed_B_T = torch.zeros_like(outside_B_T)
    elif mode == "mask":
        weights_B_T = torch.where(outside_B_T, 0.0, raw_B_T)
        zeroed_B_T = outside_B_T
    else:
        raise ValueError(f"unknown mis_mode {mode!r}")
    weights_B_T = torch.where(mask_B_T, weights_B_T, 0.0)
    metrics = {
        "mis_mean": _masked_mean(raw_B_T, mask_B_T, token_normaliser),
        "mis_clipfrac": _masked_mean(outside_B_T.float(), mask_B_T, token_normaliser),
        "mis_abs": _masked_mean((raw_B_T - 1).abs(), mask_B_T, token_normaliser),
        "mis_masked_frac": _masked_mean(zeroed_B_T.float(), mask_B_T, token_normaliser),
    }
    return weights_B_T, metrics


def ess_ratio(weights_B_T: Tensor, mask_B_T: Tensor) -> float:
    """Normalised effective sample size (Σw)² / (n·Σw²) over the n masked-in tokens, in (0, 1].

    1 means uniform weights. No tokens gives 1 (nothing is degenerate); all-zero weights give 0.
    """
    mask_B_T = mask_B_T > 0
    w_B_T = torch.where(mask_B_T, weights_B_T.detach().float(), 0.0)
    n = float(mask_B_T.sum())
    sum_sq = float(w_B_T.square().sum())
    if n == 0:
        return 1.0
    if sum_sq == 0:
        return 0.0
    return float(w_B_T.sum()) ** 2 / (n * sum_sq)


def train_rollout_kl(
    train_logprobs_B_T: Tensor,
    rollout_logprobs_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    token_normaliser: float | None = None,
) -> float:
    """Masked mean of the k3 estimate of KL(rollout ‖ train) on the rollout's own samples.

    With d = rollout − train and r = exp(−d) = π_train/π_rollout, k3 = (r − 1) − log r
    = expm1(−d) + d: unbiased for samples drawn from the rollout policy, and never negative.
    """
    mask_B_T = mask_B_T > 0
    neg_d_B_T = _log_ratio(train_logprobs_B_T, rollout_logprobs_B_T, mask_B_T).clamp(
        -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP
    )
    k3_B_T = torch.expm1(neg_d_B_T) - neg_d_B_T
    return _masked_mean(k3_B_T, mask_B_T, token_normaliser)
