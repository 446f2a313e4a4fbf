"""The RL objective on one micro-batch: token-level advantages, the policy loss with its
train–inference corrections, and the metrics that explain it.

The estimator and the policy loss are the objects `algorithms` resolves from the config; the
math lives in `losses`, `advantages` and `correction` (pure functions, tested against closed
forms). This module wires them to a micro-batch.

Which log-probs the ratio is taken against: the rollout's by default (one optimiser step per
batch, so the rollout policy *is* the behaviour policy). With TIS or MIS on, the ratio is
taken against the trainer's own log-probs before the update (`logp.detach()`, the same
weights) and the train/rollout mismatch is corrected by the importance weights instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verst.plugins import TokenInputs
from verst.train.advantages import masked_whiten, opd_advantages
from verst.train.algorithms import LossConfig
from verst.train.batching import MicroBatch
from verst.train.correction import ess_ratio, mis_weights, tis_weights, train_rollout_kl
from verst.train.losses import aggregate, kl_penalty


@dataclass
class Normalisers:
    """Denominators shared by every micro-batch of a step (global counts ÷ world size)."""

    tokens: float
    sequences: float
    constant: float  # the per-sequence divisor of the `constant` aggregation


def needs_advantage_pass(cfg: LossConfig) -> bool:
    """Whether advantages depend on more than the sequence's own reward and group."""
    return (
        cfg.estimator.token_level or cfg.kl_coef > 0 or cfg.whiten_advantages or cfg.opd is not None
    )


def set_token_advantages(
    cfg: LossConfig,
    micro: MicroBatch,
    kl_B_T: torch.Tensor,
    values_B_T: torch.Tensor | None,
) -> None:
    """Fill `micro.advantages_B_T` (and, with a critic, its values and returns) from rewards,
    the KL to the reference (zeros when unused) and the critic's values; then, with `loss.opd`,
    move each token's advantage by the teacher's verdict (after any estimator, before
    whitening)."""
    inputs = TokenInputs(
        rewards_B=micro.rewards_B,
        sequence_advantages_B_T=micro.advantages_B_T,
        mask_B_T=micro.loss_mask_B_T,
        kl_B_T=kl_B_T,
        values_B_T=values_B_T,
    )
    advantages, returns = cfg.estimator.token_advantages(inputs, cfg)
    if returns is not None:
        micro.old_values_B_T, micro.returns_B_T = values_B_T, returns
    micro.advantages_B_T = advantages * micro.loss_mask_B_T
    if cfg.opd is not None:
        if micro.teacher_logprobs_B_T is None:
            if micro.loss_mask_B_T.any():  # a masked-out stand-in has nothing to move
                raise ValueError("loss.opd is set but the batch carries no teacher log-probs")
            return
        micro.advantages_B_T = opd_advantages(
            micro.advantages_B_T,
            micro.rollout_logprobs_B_T,
            micro.teacher_logprobs_B_T,
            micro.loss_mask_B_T,
            coef=cfg.opd.coef,
        )


def whiten_globally(micros: list[MicroBatch], device: torch.device, group: Any = None) -> None:
    """(A − mean) / std over every masked token of the step, on all ranks (of the process
    group `group`, when given: ranks that hold distinct items) together."""
    whitened = masked_whiten(
        [micro.advantages_B_T for micro in micros],
        [micro.loss_mask_B_T for micro in micros],
        device,
        group,
    )
    for micro, advantages in zip(micros, whitened, strict=True):
        micro.advantages_B_T = advantages


def policy_objective(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    entropy_B_T: torch.Tensor,
    micro: MicroBatch,
    norms: Normalisers,
    ref_logprobs_B_T: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the step's policy loss, and its share of each metric, from
    the trainer's fp32 log-prob and entropy [B, T] of each response token."""
    mask = micro.loss_mask_B_T
    rollout = micro.rollout_logprobs_B_T

    def reduce(values_B_T: torch.Tensor) -> torch.Tensor:
        return aggregate(
            values_B_T,
            mask,
            cfg.loss_aggregation,
            token_normaliser=norms.tokens,
            num_sequences=norms.sequences,
            constant_normaliser=norms.constant,
        )

    corrected = cfg.use_tis or cfg.mis_level is not None
    old = logprobs.detach() if corrected else rollout
    pg, clipped = cfg.policy_loss_fn(logprobs, old, micro.advantages_B_T, mask, cfg)
    stats: dict[str, float] = {}
    if cfg.use_tis:
        weights, weight_stats = tis_weights(
            logprobs,
            rollout,
            mask,
            low=cfg.tis_clip_low,
            high=cfg.tis_clip_high,
            token_normaliser=norms.tokens,
        )
    elif cfg.mis_level is not None:
        weights, weight_stats = mis_weights(
            logprobs,
            rollout,
            mask,
            level=cfg.mis_level,
            mode=cfg.mis_mode,
            low=cfg.mis_low,
            high=cfg.mis_high,
            token_normaliser=norms.tokens,
        )
    if corrected:
        pg = pg * weights
        share = float(mask.sum()) / norms.tokens
        stats |= weight_stats | {"ess_ratio": ess_ratio(weights, mask) * share}
    loss = reduce(pg)
    stats["pg_loss"] = loss.item()
    if cfg.kl_loss_coef > 0:
        assert ref_logprobs_B_T is not None
        kl = reduce(kl_penalty(logprobs, ref_logprobs_B_T, cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl
        stats["kl_loss"] = kl.item()
    entropy = reduce(entropy_B_T)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * entropy
    stats["entropy"] = entropy.item()
    with torch.no_grad():
        diff = (logprobs - rollout).abs()
        stats["pg_clipfrac"] = float((clipped * mask).sum()) / norms.tokens
        stats["train_rollout_logprob_abs_diff"] = float((diff * mask).sum()) / norms.tokens
        stats["train_rollout_kl"] = train_rollout_kl(
            logprobs, rollout, mask, token_normaliser=norms.tokens
        )
    stats["loss"] = loss.item()
    return loss, stats
