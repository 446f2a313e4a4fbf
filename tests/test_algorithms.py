"""The algorithm registry and the loss config: what each estimator promises, how names and
import paths resolve, and the errors that name the field."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from examples.custom_algorithm import RLOO, unclipped_policy_gradient
from verst.config import ConfigError, load_config
from verst.train.algorithms import (
    ESTIMATORS,
    POLICY_LOSSES,
    LossConfig,
    gspo,
    ppo_clip,
    resolve_estimator,
    resolve_policy_loss,
)

CUSTOM = "examples.custom_algorithm"


# ---------------------------------------------------------------- config


def test_config_defaults_and_clip_high() -> None:
    cfg = LossConfig()
    assert cfg.advantage_estimator == "grpo"
    assert cfg.clip_high == 0.2
    assert not cfg.needs_reference_model
    assert LossConfig(eps_clip_high=0.28).clip_high == 0.28
    assert LossConfig(kl_loss_coef=0.01).needs_reference_model


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eps_clip": 0.0}, "eps_clip"),
        ({"eps_clip": 1.0}, "eps_clip"),
        ({"eps_clip_high": -0.1}, "eps_clip_high"),
        ({"kl_loss_coef": -1.0}, "kl_loss_coef"),
        ({"entropy_coef": -0.5}, "entropy_coef"),
        ({"kl_loss_type": "k4"}, "kl_loss_type"),
        ({"loss_aggregation": "sum"}, "loss_aggregation"),
        ({"not_a_field": 1}, "not_a_field"),
        ({"advantage_estimator": "a2c"}, "advantage_estimator"),
        ({"eps_clip_c": 1.0}, "eps_clip_c"),
        ({"constant_normaliser": 0.0}, "constant_normaliser"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"gamma": 1.5}, "gamma"),
        ({"lam": -0.1}, "lam"),
        ({"value_clip": 0.0}, "value_clip"),
        ({"tis_clip_low": -1.0}, "tis_clip_low"),
        ({"mis_level": "batch"}, "mis_level"),
        ({"mis_mode": "clip"}, "mis_mode"),
        ({"mis_high": 0.0}, "mis_high"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        LossConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (
            {"kl_coef": 0.1, "kl_loss_coef": 0.1, "advantage_estimator": "ppo"},
            ("kl_coef", "kl_loss_coef"),
        ),
        ({"use_tis": True, "mis_level": "token"}, ("use_tis", "mis_level")),
        ({"kl_coef": 0.1}, ("kl_coef", "advantage_estimator='grpo'", "kl_loss_coef")),
        ({"tis_clip_low": 3.0}, ("tis_clip_low", "tis_clip_high")),
        ({"mis_low": 2.0, "mis_high": 1.0}, ("mis_low", "mis_high")),
    ],
)
def test_config_cross_field_errors_name_both_fields(kwargs: dict, names: tuple) -> None:
    with pytest.raises(ValidationError) as info:
        LossConfig(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_config_properties() -> None:
    assert LossConfig(kl_coef=0.1, advantage_estimator="ppo").needs_reference_model
    assert LossConfig(advantage_estimator="ppo").needs_critic
    assert not LossConfig(advantage_estimator="gspo").needs_critic
    # whitening: auto = on exactly for the ++ variants; explicit values win
    assert LossConfig(advantage_estimator="reinforce_plus_plus").whiten_advantages
    assert LossConfig(advantage_estimator="reinforce_plus_plus_baseline").whiten_advantages
    assert not LossConfig(advantage_estimator="ppo").whiten_advantages
    assert LossConfig(normalize_advantages=True).whiten_advantages
    cfg = LossConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=False)
    assert not cfg.whiten_advantages
    # Dr.GRPO with a per-token mean is allowed (documented as not Dr.GRPO proper)
    assert LossConfig(advantage_estimator="dr_grpo", loss_aggregation="seq_mean")


# ---------------------------------------------------------------- the registry


@pytest.mark.parametrize(
    ("name", "group", "token", "whiten", "critic", "loss"),
    [
        ("grpo", True, False, False, False, "ppo_clip"),
        ("dr_grpo", True, False, False, False, "ppo_clip"),
        ("gspo", True, False, False, False, "gspo"),
        ("reinforce_plus_plus", False, True, True, False, "ppo_clip"),
        ("reinforce_plus_plus_baseline", True, True, True, False, "ppo_clip"),
        ("ppo", False, True, False, True, "ppo_clip"),
    ],
)
def test_each_estimator_says_what_it_is(
    name: str, group: bool, token: bool, whiten: bool, critic: bool, loss: str
) -> None:
    estimator = resolve_estimator(name)
    assert estimator is ESTIMATORS[name]
    assert (estimator.group_relative, estimator.token_level) == (group, token)
    assert (estimator.whiten_by_default, estimator.needs_critic) == (whiten, critic)
    assert not estimator.needs_reference
    assert estimator.default_policy_loss == loss
    assert LossConfig(advantage_estimator=name).policy_loss_fn is POLICY_LOSSES[loss]


def test_policy_loss_field_overrides_the_estimators_own() -> None:
    assert LossConfig(advantage_estimator="gspo").policy_loss_fn is gspo
    assert LossConfig(advantage_estimator="gspo", policy_loss="ppo_clip").policy_loss_fn is ppo_clip
    assert resolve_policy_loss("gspo") is gspo


def test_unknown_names_list_the_built_ins() -> None:
    with pytest.raises(ValidationError, match="advantage_estimator") as info:
        LossConfig(advantage_estimator="a2c")
    assert all(name in str(info.value) for name in ESTIMATORS)
    with pytest.raises(ValidationError, match="policy_loss") as info:
        LossConfig(policy_loss="clipped")
    assert "ppo_clip" in str(info.value)


# ---------------------------------------------------------------- plug-ins by import path


def test_custom_estimator_and_policy_loss_load_from_config() -> None:
    cfg = load_config(
        None,
        [
            f"loss.advantage_estimator={CUSTOM}:RLOO",
            f"loss.policy_loss={CUSTOM}:unclipped_policy_gradient",
        ],
    )
    assert isinstance(cfg.loss.estimator, RLOO)  # the class is instantiated once
    assert cfg.loss.estimator is cfg.loss.estimator
    assert cfg.loss.policy_loss_fn is unclipped_policy_gradient
    assert not cfg.loss.whiten_advantages and not cfg.loss.needs_critic
    # group-relative, so a group of one is refused like any built-in group estimator
    with pytest.raises(ConfigError, match="n_samples_per_prompt"):
        load_config(
            None, [f"loss.advantage_estimator={CUSTOM}:RLOO", "rollout.n_samples_per_prompt=1"]
        )


def test_rloo_closed_form() -> None:
    # group 0: [1, 3, 5]: 1 - (3+5)/2 = -3, 3 - 3 = 0, 5 - 2 = 3; group 1: [2, 4]: -2, 2;
    # group 2: singleton -> 0
    rewards_B = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 9.0])
    group_ids_B = torch.tensor([0, 1, 0, 1, 0, 2])
    out_B = RLOO().sequence_advantages(rewards_B, group_ids_B, LossConfig())
    torch.testing.assert_close(out_B, torch.tensor([-3.0, -2.0, 0.0, 2.0, 3.0, 0.0]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("loss.advantage_estimator=no_such_pkg.mod:Thing", "no_such_pkg.mod:Thing"),
        (f"loss.advantage_estimator={CUSTOM}:Missing", f"{CUSTOM}:Missing"),
        (f"loss.policy_loss={CUSTOM}:Missing", f"{CUSTOM}:Missing"),
        (f"loss.advantage_estimator={CUSTOM}:unclipped_policy_gradient", "group_relative"),
        (f"loss.policy_loss={CUSTOM}:__doc__", "not callable"),
    ],
)
def test_bad_import_paths_name_the_field_and_the_path(override: str, message: str) -> None:
    field = override.partition("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert field in str(info.value) and message in str(info.value), str(info.value)
