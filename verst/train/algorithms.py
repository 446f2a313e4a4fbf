"""The RL algorithm in one place: its config (`LossConfig`), every advantage estimator and
policy loss as an object, and the registry that resolves a config's names to them.

An estimator says what it is (group-relative? token-level? whitened by default? does it need a
critic or a reference model?) and computes advantages in two phases: `sequence_advantages`
over whole groups as the loop hands samples to the trainer, then `token_advantages` per
micro-batch in the trainer's advantage pass, which runs only for token-level estimators or
whitening. A policy loss turns log-probs and advantages into a per-token loss. The math both
call lives in `advantages` and `losses` (pure functions, tested against closed forms).

`loss.advantage_estimator` and `loss.policy_loss` take a built-in name or an import path
`pkg.mod:obj` (a class there is instantiated without arguments); both are checked when the
config loads, and the error names the field and the path.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import Tensor

from verst.configbase import ConfigBase
from verst.plugin_loader import load_plugin
from verst.plugins import AdvantageEstimator, PolicyLoss, TokenInputs
from verst.train.advantages import (
    gae,
    group_advantages,
    reinforce_plus_plus_advantages,
    terminal_token_rewards,
)
from verst.train.losses import Aggregation, KLType, gspo_log_ratio, policy_loss_from_log_ratio
from verst.train.opd import OPDConfig
from verst.types import Sample

MisLevel = Literal["token", "sequence", "geometric"]
MisMode = Literal["truncate", "mask"]


# ---------------------------------------------------------------- built-in estimators


class GRPO:
    """(r − group mean) / (group std + 1e-6) on every token; `grpo_std_normalization: false`
    drops the std."""

    group_relative = True
    token_level = False
    whiten_by_default = False
    needs_critic = False
    needs_reference = False
    default_policy_loss = "ppo_clip"
    divides_by_std = True

    def sequence_advantages(
        self, rewards_B: Tensor, group_ids_B: Tensor, cfg: LossConfig
    ) -> Tensor:
        std = self.divides_by_std and cfg.grpo_std_normalization
        return group_advantages(rewards_B, group_ids_B, std_normalization=std)

    def token_advantages(
        self, inputs: TokenInputs, cfg: LossConfig
    ) -> tuple[Tensor, Tensor | None]:
        return inputs.sequence_advantages_B_T, None


class DrGRPO(GRPO):
    """Dr.GRPO: r − group mean, never divided by the std (proper with `constant` aggregation)."""

    divides_by_std = False


class GSPO(GRPO):
    """GRPO's advantages under GSPO's sequence-level ratio (proper with `seq_mean`)."""

    default_policy_loss = "gspo"


class ReinforcePlusPlus:
    """Discounted returns of the token rewards r·[t is last] − kl_coef·KL_t."""

    group_relative = False
    token_level = True
    whiten_by_default = True
    needs_critic = False
    needs_reference = False
    default_policy_loss = "ppo_clip"

    def sequence_advantages(
        self, rewards_B: Tensor, group_ids_B: Tensor, cfg: LossConfig
    ) -> Tensor:
        return rewards_B  # the token advantages are built from the rewards in the trainer

    def token_advantages(
        self, inputs: TokenInputs, cfg: LossConfig
    ) -> tuple[Tensor, Tensor | None]:
        advantages_B_T = reinforce_plus_plus_advantages(
            inputs.rewards_B, inputs.kl_B_T, inputs.mask_B_T, kl_coef=cfg.kl_coef, gamma=cfg.gamma
        )
        return advantages_B_T, None


class ReinforcePlusPlusBaseline:
    """REINFORCE++ with a group baseline: (r − group mean) on every token − kl_coef·KL_t."""

    group_relative = True
    token_level = True
    whiten_by_default = True
    needs_critic = False
    needs_reference = False
    default_policy_loss = "ppo_clip"

    def sequence_advantages(
        self, rewards_B: Tensor, group_ids_B: Tensor, cfg: LossConfig
    ) -> Tensor:
        return group_advantages(rewards_B, group_ids_B, std_normalization=False)

    def token_advantages(
        self, inputs: TokenInputs, cfg: LossConfig
    ) -> tuple[Tensor, Tensor | None]:
        return inputs.sequence_advantages_B_T - cfg.kl_coef * inputs.kl_B_T, None


class PPO:
    """GAE(γ, λ) on a learned critic's values, with r on the last token − kl_coef·KL_t."""

    group_relative = False
    token_level = True
    whiten_by_default = False
    needs_critic = True
    needs_reference = False
    default_policy_loss = "ppo_clip"

    def sequence_advantages(
        self, rewards_B: Tensor, group_ids_B: Tensor, cfg: LossConfig
    ) -> Tensor:
        return rewards_B  # the token advantages are built from the rewards in the trainer

    def token_advantages(
        self, inputs: TokenInputs, cfg: LossConfig
    ) -> tuple[Tensor, Tensor | None]:
        if inputs.values_B_T is None:
            raise ValueError("ppo's advantages need the critic's values")
        terminal_B_T = terminal_token_rewards(inputs.rewards_B, inputs.mask_B_T)
        token_rewards_B_T = terminal_B_T - cfg.kl_coef * inputs.kl_B_T
        return gae(
            token_rewards_B_T, inputs.values_B_T, inputs.mask_B_T, gamma=cfg.gamma, lam=cfg.lam
        )


# ---------------------------------------------------------------- built-in policy losses


def ppo_clip(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    cfg: LossConfig,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate on the per-token ratio exp(logp − old); clip-higher, dual clip."""
    return policy_loss_from_log_ratio(
        logprobs_B_T - old_logprobs_B_T,
        advantages_B_T,
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.clip_high,
        eps_clip_c=cfg.eps_clip_c,
    )


def gspo(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    cfg: LossConfig,
) -> tuple[Tensor, Tensor]:
    """The clipped surrogate on GSPO's sequence ratio exp(mean_t (logp − old)), on every token."""
    return policy_loss_from_log_ratio(
        gspo_log_ratio(logprobs_B_T, old_logprobs_B_T, mask_B_T),
        advantages_B_T,
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.clip_high,
        eps_clip_c=cfg.eps_clip_c,
    )


# ---------------------------------------------------------------- the registry

ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": GRPO(),
    "dr_grpo": DrGRPO(),
    "gspo": GSPO(),
    "reinforce_plus_plus": ReinforcePlusPlus(),
    "reinforce_plus_plus_baseline": ReinforcePlusPlusBaseline(),
    "ppo": PPO(),
}
POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": ppo_clip, "gspo": gspo}

_ESTIMATOR_FLAGS = (
    "group_relative",
    "token_level",
    "whiten_by_default",
    "needs_critic",
    "needs_reference",
)


def _load(name: str, builtins: dict, protocol: type, field: str) -> object:
    if name in builtins:
        return builtins[name]
    if ":" not in name and "." not in name:
        raise ValueError(
            f"{field}: unknown name {name!r}: built-ins are {', '.join(builtins)}; "
            "or give an import path 'pkg.mod:obj'"
        )
    obj = load_plugin(name, protocol, field=field)
    if not isinstance(obj, type):
        return obj
    try:
        return obj()
    except TypeError as error:
        raise ValueError(
            f"{field}: {name!r}: cannot build the class without arguments: {error}"
        ) from None


@functools.cache
def resolve_estimator(name: str) -> AdvantageEstimator:
    """The built-in estimator `name`, or the one at import path `name`; ValueError when it is
    neither or does not have every member of `AdvantageEstimator`."""
    estimator = _load(name, ESTIMATORS, AdvantageEstimator, "loss.advantage_estimator")
    problems = [f for f in _ESTIMATOR_FLAGS if not isinstance(getattr(estimator, f, None), bool)]
    if not isinstance(getattr(estimator, "default_policy_loss", None), str):
        problems.append("default_policy_loss")
    problems += [
        method
        for method in ("sequence_advantages", "token_advantages")
        if not callable(getattr(estimator, method, None))
    ]
    if problems:
        raise ValueError(
            f"advantage estimator {name!r} is not an AdvantageEstimator: it lacks (or has the "
            f"wrong type of) {', '.join(problems)}; see verst/train/algorithms.py"
        )
    resolve_policy_loss(estimator.default_policy_loss)
    return estimator  # type: ignore[return-value]


@functools.cache
def resolve_policy_loss(name: str) -> PolicyLoss:
    """The built-in policy loss `name`, or the callable at import path `name`."""
    loss = _load(name, POLICY_LOSSES, PolicyLoss, "loss.policy_loss")
    if not callable(loss):
        raise ValueError(f"policy loss {name!r} is a {type(loss).__name__}, not callable")
    return loss  # type: ignore[return-value]


def sample_advantages(samples: list[Sample], cfg: LossConfig) -> Tensor:
    """Each sample's sequence-level advantage under the config's estimator, its group being
    the samples of the same `group_index`."""
    rewards_B = torch.tensor([s.reward or 0.0 for s in samples], dtype=torch.float64)
    group_ids_B = torch.tensor([s.group_index for s in samples])
    return cfg.estimator.sequence_advantages(rewards_B, group_ids_B, cfg)


# ---------------------------------------------------------------- the config


class LossConfig(ConfigBase):
    """How advantages are estimated and how the policy loss is built and reduced.

    Dr.GRPO proper is `advantage_estimator="dr_grpo"` with `loss_aggregation="constant"`;
    dr_grpo with token_mean / seq_mean is allowed (only the std division is dropped then).
    GSPO proper reduces with seq_mean: its token-level form then has the sequence-level gradient.
    """

    advantage_estimator: str = Field(
        "grpo",
        description="grpo | dr_grpo | gspo | reinforce_plus_plus | "
        "reinforce_plus_plus_baseline | ppo (GAE with a critic) | pkg.mod:Estimator",
    )
    policy_loss: str | None = Field(
        None,
        description="ppo_clip | gspo | pkg.mod:fn; None = the estimator's own "
        "(gspo for gspo, ppo_clip otherwise)",
    )
    grpo_std_normalization: bool = Field(
        True, description="grpo and gspo: divide advantages by the group std (dr_grpo never does)"
    )
    eps_clip: float = Field(
        0.2, gt=0, lt=1, description="PPO clip range below 1: ratio >= 1 - eps_clip"
    )
    eps_clip_high: float | None = Field(
        None, gt=0, description="PPO clip range above 1 (DAPO clip-higher); None = eps_clip"
    )
    eps_clip_c: float | None = Field(
        None, gt=1, description="dual-clip PPO: for A < 0 the loss is capped at -A*eps_clip_c"
    )
    loss_aggregation: Aggregation = Field(
        "token_mean",
        description="token_mean: mean over all tokens (DAPO); seq_mean: mean of sequence means; "
        "constant: sum / (constant_normaliser * sequences) (Dr.GRPO)",
    )
    constant_normaliser: float | None = Field(
        None,
        gt=0,
        description="divisor per sequence of the constant aggregation; None = max_new_tokens",
    )
    kl_loss_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the KL loss to the reference (the policy as RL starts)",
    )
    kl_loss_type: KLType = Field("k3", description="KL estimator: k1 | k2 | k3 | low_var_kl")
    kl_coef: float = Field(
        0.0, ge=0, description="KL as reward shaping: per-token reward -kl_coef*KL (ppo, ++ only)"
    )
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus (subtracted)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of ppo (GAE) and reinforce++")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda of ppo")
    value_clip: float = Field(0.2, gt=0, description="ppo critic: clip range of the value update")
    normalize_advantages: bool | None = Field(
        None,
        description="whiten advantages over the batch; None = on for the reinforce++ variants",
    )
    use_tis: bool = Field(
        False, description="truncated importance sampling of train vs rollout log-probs"
    )
    tis_clip_low: float = Field(0.0, ge=0, description="TIS weights are clamped to at least this")
    tis_clip_high: float = Field(2.0, gt=0, description="TIS weights are clamped to at most this")
    mis_level: MisLevel | None = Field(
        None, description="masked importance sampling level: token | sequence | geometric"
    )
    mis_mode: MisMode = Field(
        "truncate", description="MIS: truncate = clamp weights; mask = zero out-of-range weights"
    )
    mis_low: float = Field(0.0, ge=0, description="MIS lower bound of the accepted weight")
    mis_high: float = Field(2.0, gt=0, description="MIS upper bound of the accepted weight")
    routing_replay: bool = Field(
        False,
        description="MoE (R3): the trainer's MoE layers use the experts recorded at rollout, "
        "with gate weights from its own router scores at them (the router still learns)",
    )
    opd: OPDConfig | None = Field(
        None,
        description="on-policy distillation: teachers score the sampled tokens and each "
        "token's advantage moves by -coef*(logp_student - logp_teacher); unset = off",
    )

    @field_validator("advantage_estimator")
    @classmethod
    def _estimator_resolves(cls, value: str) -> str:
        resolve_estimator(value)
        return value

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss_resolves(cls, value: str | None) -> str | None:
        if value is not None:
            resolve_policy_loss(value)
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> LossConfig:
        if self.kl_coef > 0 and self.kl_loss_coef > 0:
            raise ValueError(
                "kl_coef (KL as reward) and kl_loss_coef (KL as loss) are mutually exclusive: "
                "set one of them to 0"
            )
        if self.kl_coef > 0 and not self.estimator.token_level:
            raise ValueError(
                f"kl_coef shapes per-token rewards, which advantage_estimator="
                f"{self.advantage_estimator!r} ignores; use kl_loss_coef instead"
            )
        if self.use_tis and self.mis_level is not None:
            raise ValueError(
                "use_tis and mis_level are mutually exclusive: pick one mismatch correction"
            )
        if self.tis_clip_low >= self.tis_clip_high:
            raise ValueError("tis_clip_low must be below tis_clip_high")
        if self.mis_low >= self.mis_high:
            raise ValueError("mis_low must be below mis_high")
        return self

    @property
    def estimator(self) -> AdvantageEstimator:
        """The advantage estimator object `advantage_estimator` names."""
        return resolve_estimator(self.advantage_estimator)

    @property
    def policy_loss_fn(self) -> PolicyLoss:
        """The policy loss `policy_loss` names, or the estimator's default one."""
        return resolve_policy_loss(self.policy_loss or self.estimator.default_policy_loss)

    @property
    def clip_high(self) -> float:
        """The effective upper clip range (eps_clip_high, or eps_clip when unset)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def whiten_advantages(self) -> bool:
        """Whether advantages are whitened over the batch (normalize_advantages, or its default)."""
        if self.normalize_advantages is None:
            return self.estimator.whiten_by_default
        return self.normalize_advantages

    @property
    def needs_reference_model(self) -> bool:
        """Whether the trainer must keep a frozen reference model (KL as loss or as reward, or
        an estimator that reads the KL)."""
        return self.kl_loss_coef > 0.0 or self.kl_coef > 0.0 or self.estimator.needs_reference

    @property
    def needs_critic(self) -> bool:
        """Whether the trainer must train a value model (ppo's GAE)."""
        return self.estimator.needs_critic
