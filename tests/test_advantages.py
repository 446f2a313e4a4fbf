"""Advantage estimators against closed forms worked out by hand on tiny tensors."""

from __future__ import annotations

import torch

from verst.train.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    terminal_token_rewards,
)
from verst.train.losses import group_advantages


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0
    )


def assert_finite(x: torch.Tensor) -> None:
    assert torch.isfinite(x).all(), x


# ---------------------------------------------------------------- group estimators


def test_dr_grpo_is_centered_never_divided() -> None:
    # group 7: [1, 3] mean 2 -> [-1, 1]; group 2: singleton -> 0; group 5: [0, 0, 3] mean 1
    rewards_N = torch.tensor([1.0, 4.0, 0.0, 3.0, 0.0, 3.0])
    group_ids_N = torch.tensor([7, 2, 5, 7, 5, 5])
    close(dr_grpo_advantages(rewards_N, group_ids_N), [-1.0, 0.0, -1.0, 1.0, -1.0, 2.0])
    # all-equal rewards -> 0 for every estimator of the group family
    equal_N = torch.full((4,), 0.7)
    ids_N = torch.zeros(4, dtype=torch.long)
    close(dr_grpo_advantages(equal_N, ids_N), [0.0] * 4)
    close(group_advantages(equal_N, ids_N, std_normalization=True), [0.0] * 4)


def test_group_advantages_still_importable_from_losses() -> None:
    from verst.train import advantages, losses

    assert losses.group_advantages is advantages.group_advantages
    assert losses.grpo_advantages is advantages.grpo_advantages


# ---------------------------------------------------------------- token rewards and returns


def test_terminal_token_rewards() -> None:
    # last masked-in token: row 0 -> t1, row 1 -> t2 (t1 masked), row 2 empty -> nowhere
    mask_N_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    close(
        terminal_token_rewards(torch.tensor([2.0, 5.0, 7.0]), mask_N_T),
        [[0.0, 2.0, 0.0], [0.0, 0.0, 5.0], [0.0, 0.0, 0.0]],
    )
    assert terminal_token_rewards(torch.tensor([1.0]), torch.zeros(1, 0)).shape == (1, 0)


def test_discounted_returns() -> None:
    # gamma 0.5 on [1, 2, 4]: G2 = 4, G1 = 2 + 0.5*4 = 4, G0 = 1 + 0.5*4 = 3
    rewards_N_T = torch.tensor([[1.0, 2.0, 4.0], [1.0, 100.0, 4.0]])
    full_N_T = torch.ones(2, 3)
    gap_N_T = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    close(discounted_returns(rewards_N_T[:1], full_N_T[:1], 0.5), [[3.0, 4.0, 4.0]])
    # a masked t1 drops its reward (100) and does not discount the chain: G0 = 1 + 0.5*4 = 3
    close(discounted_returns(rewards_N_T, gap_N_T, 0.5), [[3.0, 4.0, 4.0], [3.0, 0.0, 4.0]])
    # gamma 1 (the cumsum path): [7, 6, 4] and [5, 0, 4]
    close(discounted_returns(rewards_N_T, gap_N_T, 1.0), [[7.0, 6.0, 4.0], [5.0, 0.0, 4.0]])


def test_reinforce_plus_plus_with_kl_and_gamma() -> None:
    # kl_coef 0.5, gamma 0.5.
    # row 0: token rewards [-0.05, -0.1, -0.2 + 1] -> G2 = 0.8, G1 = -0.1 + 0.4 = 0.3,
    #        G0 = -0.05 + 0.15 = 0.1
    # row 1 (t1 masked): [-0.1, -, -0.1 + 2] -> G2 = 1.9, G0 = -0.1 + 0.95 = 0.85
    # row 2 empty -> 0
    kl_N_T = torch.tensor([[0.1, 0.2, 0.4], [0.2, 9.0, 0.2], [1.0, 1.0, 1.0]])
    mask_N_T = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    out = reinforce_plus_plus_advantages(
        torch.tensor([1.0, 2.0, 3.0]), kl_N_T, mask_N_T, kl_coef=0.5, gamma=0.5
    )
    close(out, [[0.1, 0.3, 0.8], [0.85, 0.0, 1.9], [0.0, 0.0, 0.0]])


def test_reinforce_plus_plus_baseline() -> None:
    # group 0: [1, 3] mean 2 -> [-1, 1]; group 1: singleton -> 0; then minus 0.5*kl per token
    # row 0: [-1 - 0.1, -1 - 0.2]; row 1: [1 - 0, masked]; row 2: [0 - 0.5, 0 - 0.5]
    kl_N_T = torch.tensor([[0.2, 0.4], [0.0, 0.2], [1.0, 1.0]])
    mask_N_T = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    out = reinforce_plus_plus_baseline_advantages(
        torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), kl_N_T, mask_N_T, kl_coef=0.5
    )
    close(out, [[-1.1, -1.2], [1.0, 0.0], [-0.5, -0.5]])


# ---------------------------------------------------------------- GAE


def test_gae_one_sequence() -> None:
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72), V = [0.5, 0.6, 0.7], r = [0, 0, 1], V_3 = 0
    # d2 = 1 - 0.7 = 0.3                 A2 = 0.3
    # d1 = 0.9*0.7 - 0.6 = 0.03           A1 = 0.03 + 0.72*0.3 = 0.246
    # d0 = 0.9*0.6 - 0.5 = 0.04           A0 = 0.04 + 0.72*0.246 = 0.21712
    adv_N_T, ret_N_T = gae(
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 0.6, 0.7]]),
        torch.ones(1, 3),
        gamma=0.9,
        lam=0.8,
    )
    close(adv_N_T, [[0.21712, 0.246, 0.3]])
    close(ret_N_T, [[0.71712, 0.846, 1.0]])


def test_gae_masked() -> None:
    # row 0, t2 padding: d1 = 1 - 0.6 = 0.4, A1 = 0.4; d0 = 0.9*0.6 - 0.5 = 0.04,
    #   A0 = 0.04 + 0.72*0.4 = 0.328; returns [0.828, 1.0, 0]
    # row 1, t1 masked (skipped, its 99s ignored): d2 = 1 - 0.4 = 0.6, A2 = 0.6;
    #   d0 = 0.5 + 0.9*0.4 - 0.2 = 0.66, A0 = 0.66 + 0.72*0.6 = 1.092; returns [1.292, 0, 1.0]
    # row 2 empty -> all 0
    rewards_N_T = torch.tensor([[0.0, 1.0, 7.0], [0.5, 99.0, 1.0], [1.0, 1.0, 1.0]])
    values_N_T = torch.tensor([[0.5, 0.6, 7.0], [0.2, 99.0, 0.4], [1.0, 1.0, 1.0]])
    mask_N_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    adv_N_T, ret_N_T = gae(rewards_N_T, values_N_T, mask_N_T, gamma=0.9, lam=0.8)
    close(adv_N_T, [[0.328, 0.4, 0.0], [1.092, 0.0, 0.6], [0.0, 0.0, 0.0]])
    close(ret_N_T, [[0.828, 1.0, 0.0], [1.292, 0.0, 1.0], [0.0, 0.0, 0.0]])


def test_gae_lambda_one_returns_are_discounted_returns() -> None:
    torch.manual_seed(0)
    rewards_N_T = torch.randn(3, 6)
    values_N_T = torch.randn(3, 6)
    mask_N_T = (torch.rand(3, 6) > 0.3).float()
    _, ret_N_T = gae(rewards_N_T, values_N_T, mask_N_T, gamma=0.9, lam=1.0)
    torch.testing.assert_close(ret_N_T, discounted_returns(rewards_N_T, mask_N_T, 0.9))


# ---------------------------------------------------------------- whitening


def test_masked_whiten() -> None:
    # entries 1, 2, 3, 4 (the 100s are padding): mean 2.5, squares 2.25 + 0.25 + 0.25 + 2.25 = 5,
    # unbiased var 5/3, std 1.2909944 -> ±1.5/std = ±1.1618950, ±0.5/std = ±0.3872983
    x_N_T = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 100.0]])
    mask_N_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    a, b = 1.1618950, 0.3872983
    close(masked_whiten(x_N_T, mask_N_T), [[-a, -b, 0.0], [b, a, 0.0]])
    close(
        masked_whiten(x_N_T, mask_N_T, shift_mean=False),
        [[2.5 - a, 2.5 - b, 0.0], [2.5 + b, 2.5 + a, 0.0]],
    )


def test_edge_cases_give_zeros_not_nan() -> None:
    empty_N_T = torch.zeros(2, 3)
    x_N_T = torch.ones(2, 3)
    rewards_N = torch.tensor([1.0, 2.0])
    ids_N = torch.tensor([0, 1])
    outs = [
        masked_whiten(x_N_T, empty_N_T),
        masked_whiten(x_N_T, torch.tensor([[1.0, 0, 0], [0, 0, 0]])),  # one entry: nothing to scale
        discounted_returns(x_N_T, empty_N_T, 0.9),
        reinforce_plus_plus_advantages(rewards_N, x_N_T, empty_N_T, kl_coef=0.1, gamma=0.9),
        reinforce_plus_plus_baseline_advantages(rewards_N, ids_N, x_N_T, empty_N_T, kl_coef=0.1),
        *gae(x_N_T, x_N_T, empty_N_T, gamma=0.9, lam=0.9),
    ]
    for out in outs:
        close(out, [[0.0] * 3] * 2)
