"""The loss math against closed forms worked out by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from verst.train.algorithms import LossConfig, gspo, ppo_clip
from verst.train.losses import (
    aggregate,
    entropy_from_logits,
    gspo_log_ratio,
    kl_penalty,
    logprobs_from_logits,
    policy_loss_from_log_ratio,
    value_loss,
)


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0
    )


# ---------------------------------------------------------------- KL


def test_kl_penalty_kinds() -> None:
    # d = logp - ref at three points: 0, ln 2, -ln 2
    ln2 = math.log(2.0)
    logp_B_T = torch.tensor([[-1.0, -1.0 + ln2, -1.0 - ln2]])
    ref_B_T = torch.full((1, 3), -1.0)
    close(kl_penalty(logp_B_T, ref_B_T, "k1"), [[0.0, ln2, -ln2]])
    # k2 = d^2 / 2: ln2^2 = 0.480453 -> 0.2402265
    close(kl_penalty(logp_B_T, ref_B_T, "k2"), [[0.0, 0.2402265, 0.2402265]])
    # k3 = exp(-d) - (-d) - 1: d=ln2 -> 0.5 + ln2 - 1 = 0.1931472; d=-ln2 -> 2 - ln2 - 1 = 0.3068528
    close(kl_penalty(logp_B_T, ref_B_T, "k3"), [[0.0, 0.1931472, 0.3068528]])
    close(kl_penalty(logp_B_T, ref_B_T, "low_var_kl"), [[0.0, 0.1931472, 0.3068528]])


def test_low_var_kl_is_clamped() -> None:
    # d = -5: k3 = e^5 - 5 - 1 = 142.41 -> clamped to 10
    logp_B_T = torch.tensor([[-6.0]])
    ref_B_T = torch.tensor([[-1.0]])
    close(kl_penalty(logp_B_T, ref_B_T, "k3"), [[math.exp(5) - 6]], atol=1e-3)
    close(kl_penalty(logp_B_T, ref_B_T, "low_var_kl"), [[10.0]])


# ---------------------------------------------------------------- policy loss


def policy_loss(
    logp_B_T: torch.Tensor, old_B_T: torch.Tensor, adv_B_T: torch.Tensor, **clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The built-in `ppo_clip` policy loss as the trainer calls it, clip ranges from config."""
    return ppo_clip(logp_B_T, old_B_T, adv_B_T, torch.ones_like(adv_B_T), LossConfig(**clip))


def _ratios(*ratios: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp_B_T = torch.tensor([[math.log(r) for r in ratios]])
    return logp_B_T, torch.zeros_like(logp_B_T)


def test_policy_loss_positive_advantage() -> None:
    # A = 2, eps 0.2: ratio 1.1 inside -> -2.2; 0.5 below -> max(-1.0, -1.6) = -1.0 (unclipped);
    # 1.5 above -> max(-3.0, -2.4) = -2.4 (clipped)
    logp_B_T, old_B_T = _ratios(1.1, 0.5, 1.5)
    loss_B_T, clipped_B_T = policy_loss(
        logp_B_T, old_B_T, torch.full((1, 3), 2.0), eps_clip=0.2, eps_clip_high=None
    )
    close(loss_B_T, [[-2.2, -1.0, -2.4]])
    close(clipped_B_T, [[0.0, 0.0, 1.0]])


def test_policy_loss_negative_advantage() -> None:
    # A = -1: ratio 1.1 -> 1.1; 0.5 below -> max(0.5, 0.8) = 0.8 (clipped);
    # 1.5 above -> max(1.5, 1.2) = 1.5 (unclipped)
    logp_B_T, old_B_T = _ratios(1.1, 0.5, 1.5)
    loss_B_T, clipped_B_T = policy_loss(
        logp_B_T, old_B_T, torch.full((1, 3), -1.0), eps_clip=0.2, eps_clip_high=None
    )
    close(loss_B_T, [[1.1, 0.8, 1.5]])
    close(clipped_B_T, [[0.0, 1.0, 0.0]])


def test_policy_loss_clip_higher_is_asymmetric() -> None:
    # A = 1, eps 0.2, eps_high 0.28: ratio 1.25 now inside -> -1.25; 1.4 -> clip at 1.28;
    # 0.7 -> max(-0.7, -0.8) = -0.7 (lower bound unchanged, unclipped for A > 0)
    logp_B_T, old_B_T = _ratios(1.25, 1.4, 0.7)
    loss_B_T, clipped_B_T = policy_loss(
        logp_B_T, old_B_T, torch.ones(1, 3), eps_clip=0.2, eps_clip_high=0.28
    )
    close(loss_B_T, [[-1.25, -1.28, -0.7]])
    close(clipped_B_T, [[0.0, 1.0, 0.0]])
    # A = -1 with the same clip: 0.7 is clipped at the unchanged lower bound 0.8
    loss_B_T, clipped_B_T = policy_loss(
        logp_B_T, old_B_T, -torch.ones(1, 3), eps_clip=0.2, eps_clip_high=0.28
    )
    close(loss_B_T, [[1.25, 1.4, 0.8]])
    close(clipped_B_T, [[0.0, 0.0, 1.0]])


def test_policy_loss_gradient_on_policy_and_extreme_ratio() -> None:
    # At ratio 1, d(-A * ratio)/d logp = -A.
    logp_B_T = torch.zeros(1, 2, requires_grad=True)
    loss_B_T, _ = policy_loss(
        logp_B_T, torch.zeros(1, 2), torch.tensor([[0.5, -2.0]]), eps_clip=0.2
    )
    loss_B_T.sum().backward()
    close(logp_B_T.grad, [[-0.5, 2.0]])
    # A log-ratio of 1000 is clamped to 20 before exp: finite.
    loss_B_T, _ = policy_loss(
        torch.tensor([[1000.0]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), eps_clip=0.2
    )
    close(loss_B_T, [[math.exp(20.0)]], atol=1.0)


def test_dual_clip_caps_negative_advantage() -> None:
    # A = -1, eps 0.2, eps_clip_c 3: ratio 1.1 -> 1.1; 0.5 -> PPO clip 0.8;
    # 5.0 -> PPO max(5, 1.2) = 5, dual min(5, 3) = 3; 2.5 -> 2.5 (below the cap)
    logp_B_T, old_B_T = _ratios(1.1, 0.5, 5.0, 2.5)
    logp_B_T.requires_grad_(True)
    loss_B_T, clipped_B_T = policy_loss(
        logp_B_T, old_B_T, -torch.ones(1, 4), eps_clip=0.2, eps_clip_c=3.0
    )
    close(loss_B_T, [[1.1, 0.8, 3.0, 2.5]])
    close(clipped_B_T, [[0.0, 1.0, 1.0, 0.0]])
    # no gradient through either clip; d(-A*r)/dlogp = r elsewhere
    loss_B_T.sum().backward()
    close(logp_B_T.grad, [[1.1, 0.0, 0.0, 2.5]])
    # A > 0 is untouched by the dual clip: ratio 5, A 2 -> max(-10, -2.4) = -2.4
    loss_B_T, _ = policy_loss(*_ratios(5.0), torch.full((1, 1), 2.0), eps_clip=0.2, eps_clip_c=3)
    close(loss_B_T, [[-2.4]])


def test_ppo_clip_is_policy_loss_from_log_ratio() -> None:
    torch.manual_seed(0)
    logp_B_T, old_B_T, adv_B_T = torch.randn(3, 2, 5).unbind(0)
    kwargs = {"eps_clip": 0.2, "eps_clip_high": 0.28, "eps_clip_c": 3.0}
    for a, b in zip(
        policy_loss(logp_B_T, old_B_T, adv_B_T, **kwargs),
        policy_loss_from_log_ratio(logp_B_T - old_B_T, adv_B_T, **kwargs),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- GSPO

GSPO_OLD_B_T = torch.tensor([[-1.5, -2.0, -2.5], [-1.3, -0.9, -1.2]])
GSPO_MASK_B_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_gspo_log_ratio_value() -> None:
    # row 0: diffs 0.5, 0 (t2 masked) -> mean 0.25; row 1: 0.3 - 0.1 + 0.2 = 0.4 over 3 = 0.133333
    logp_B_T = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    out = gspo_log_ratio(logp_B_T, GSPO_OLD_B_T, GSPO_MASK_B_T)
    close(out, [[0.25] * 3, [0.4 / 3] * 3])
    # empty row and -inf padding: finite
    out = gspo_log_ratio(torch.tensor([[-math.inf]]), torch.zeros(1, 1), torch.zeros(1, 1))
    close(out, [[0.0]])


def test_gspo_gradient_is_the_sequence_level_one() -> None:
    # GSPO by definition: loss = mean_b(-A_b * exp(mean_t(logp - old))); the built-in `gspo`
    # policy loss (no clip active) with seq_mean must match it in value and gradient.
    adv_B = torch.tensor([1.0, -2.0])
    # row 0: diffs 0.5, 0.1 -> s = exp(0.3) = 1.35; row 1: s = exp(0.4 / 3) = 1.14
    logp_B_T = torch.tensor([[-1.0, -1.9, -9.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    mask = GSPO_MASK_B_T > 0
    diff_B_T = torch.where(mask, logp_B_T - GSPO_OLD_B_T, 0.0)
    s_B = torch.exp(diff_B_T.sum(-1) / mask.sum(-1))
    reference = (-adv_B * s_B).mean()
    (ref_grad,) = torch.autograd.grad(reference, logp_B_T)

    adv_B_T = adv_B[:, None].expand(2, 3)
    loss_B_T, clipped_B_T = gspo(
        logp_B_T, GSPO_OLD_B_T, adv_B_T, GSPO_MASK_B_T, LossConfig(eps_clip=0.5)
    )
    token_form = aggregate(loss_B_T, GSPO_MASK_B_T, "seq_mean")
    (grad,) = torch.autograd.grad(token_form, logp_B_T)
    torch.testing.assert_close(token_form, reference)
    torch.testing.assert_close(grad, ref_grad)
    close(clipped_B_T, [[0.0] * 3] * 2)
    # the clip acts on the whole sequence: row 0's ratio exp(0.3) = 1.35 > 1.2 with A > 0
    _, clipped_B_T = gspo(logp_B_T, GSPO_OLD_B_T, adv_B_T, GSPO_MASK_B_T, LossConfig())
    close(clipped_B_T, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


# ---------------------------------------------------------------- value loss


def test_value_loss_both_branches() -> None:
    # clip 0.2, v = 1 everywhere.
    # t0: old 0.5 -> clipped v 0.7, R 2: max(1, 1.69) = 1.69 -> 0.845 (clipped branch, no grad)
    # t1: old 0.5 -> clipped v 0.7, R 0: max(1, 0.49) = 1 -> 0.5 (unclipped branch, grad v-R = 1)
    # t2: old 0.9 -> inside the clip, R 0: 1 -> 0.5 (grad 1)
    values_B_T = torch.ones(1, 3, requires_grad=True)
    loss_B_T = value_loss(
        values_B_T,
        torch.tensor([[0.5, 0.5, 0.9]]),
        torch.tensor([[2.0, 0.0, 0.0]]),
        value_clip=0.2,
    )
    close(loss_B_T, [[0.845, 0.5, 0.5]])
    loss_B_T.sum().backward()
    close(values_B_T.grad, [[0.0, 1.0, 1.0]])


# ---------------------------------------------------------------- aggregation

VALUES_B_T = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 8.0, 9.0]])
MASK_B_T = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_aggregate_token_mean_and_seq_mean() -> None:
    # tokens: 1 + 2 + 3 + 4 = 10 over 4 tokens -> 2.5
    close(aggregate(VALUES_B_T, MASK_B_T, "token_mean"), 2.5)
    # sequences: mean [1, 2, 3] = 2, mean [4] = 4, empty -> 0; (2 + 4 + 0) / 3 = 2
    close(aggregate(VALUES_B_T, MASK_B_T, "seq_mean"), 2.0)
    # explicit normalisers: 10 / 8 and 6 / 6
    close(aggregate(VALUES_B_T, MASK_B_T, "token_mean", token_normaliser=8.0), 1.25)
    close(aggregate(VALUES_B_T, MASK_B_T, "seq_mean", num_sequences=6), 1.0)


def test_aggregate_constant() -> None:
    # masked sum 10 over constant 5 x B = 3 sequences -> 10 / 15; with 4 global sequences -> 0.5
    close(aggregate(VALUES_B_T, MASK_B_T, "constant", constant_normaliser=5.0), 10 / 15)
    out = aggregate(VALUES_B_T, MASK_B_T, "constant", constant_normaliser=5.0, num_sequences=4)
    close(out, 0.5)
    with pytest.raises(ValueError, match="constant_normaliser"):
        aggregate(VALUES_B_T, MASK_B_T, "constant")


def test_aggregate_empty_and_nan_padding_give_no_nan() -> None:
    empty_B_T = torch.zeros(2, 3)
    for mode in ("token_mean", "seq_mean", "constant"):
        close(aggregate(torch.ones(2, 3), empty_B_T, mode, constant_normaliser=4.0), 0.0)
    values_B_T = torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]], requires_grad=True)
    mask_B_T = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    out = aggregate(values_B_T, mask_B_T, "token_mean")
    close(out, 2.0)
    out.backward()
    close(values_B_T.grad, [[0.5, 0.0], [0.0, 0.5]])


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "constant"])
def test_aggregate_micro_batches_sum_to_full_batch(mode: str) -> None:
    torch.manual_seed(0)
    values_B_T = torch.randn(6, 5, requires_grad=True)
    mask_B_T = (torch.rand(6, 5) > 0.4).float()
    mask_B_T[4] = 0.0  # one empty response
    full = aggregate(values_B_T, mask_B_T, mode, constant_normaliser=5.0)
    (full_grad,) = torch.autograd.grad(full, values_B_T)
    num_tokens = float(mask_B_T.sum())
    parts = [
        aggregate(
            values_B_T[rows],
            mask_B_T[rows],
            mode,
            token_normaliser=num_tokens,
            num_sequences=6,
            constant_normaliser=5.0,
        )
        for rows in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    total = torch.stack(parts).sum()
    (split_grad,) = torch.autograd.grad(total, values_B_T)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_grad, full_grad)


# ---------------------------------------------------------------- logits helpers


def test_logprobs_from_logits_matches_log_softmax() -> None:
    torch.manual_seed(0)
    logits_B_T_V = torch.randn(2, 4, 11, dtype=torch.bfloat16) * 3
    tokens_B_T = torch.randint(0, 11, (2, 4))
    for temperature in (1.0, 0.7):
        expected_B_T = torch.log_softmax(logits_B_T_V.float() / temperature, dim=-1).gather(
            -1, tokens_B_T.unsqueeze(-1)
        )
        out_B_T = logprobs_from_logits(logits_B_T_V, tokens_B_T, temperature)
        assert out_B_T.dtype == torch.float32
        torch.testing.assert_close(out_B_T, expected_B_T.squeeze(-1))


def test_logprobs_closed_form() -> None:
    # logits [0, ln 3] -> probs [1/4, 3/4]
    logits_B_T_V = torch.tensor([[[0.0, math.log(3.0)]]])
    close(logprobs_from_logits(logits_B_T_V, torch.tensor([[1]])), [[math.log(0.75)]])


def test_entropy_from_logits() -> None:
    # uniform over 4 -> ln 4; probs [1/4, 3/4] -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351;
    # a -inf logit contributes nothing: [0, 0, -inf] -> ln 2
    logits_B_T_V = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9], [0.0, 0.0, -math.inf, -math.inf]]]
    )
    close(entropy_from_logits(logits_B_T_V), [[math.log(4.0), 0.5623351, math.log(2.0)]])
