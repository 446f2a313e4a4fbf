"""Advantage estimators against closed forms worked out by hand on tiny tensors.

The estimators run as production runs them (`estimator_advantages`): the sequence-level
advantage of each sample as the loop hands it to the trainer, then the trainer's per-token
advantage pass on the collated micro-batch.
"""

from __future__ import annotations

import torch

from verst.loop import train_items
from verst.train.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    terminal_token_rewards,
)
from verst.train.algorithms import LossConfig
from verst.train.batching import MicroBatch, collate
from verst.train.objective import needs_advantage_pass, set_token_advantages, whiten_globally
from verst.types import Sample

CPU = torch.device("cpu")


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0
    )


def assert_finite(x: torch.Tensor) -> None:
    assert torch.isfinite(x).all(), x


def estimator_advantages(
    rewards: list[float],
    group_ids: list[int],
    mask_B_T: torch.Tensor,
    kl_B_T: torch.Tensor | None = None,
    values_B_T: torch.Tensor | None = None,
    **loss: object,
) -> MicroBatch:
    """The micro-batch after the advantage steps of `Trainer.step`, with the KL to the
    reference and the critic's values given instead of computed by models."""
    cfg = LossConfig(**loss)
    width = mask_B_T.shape[1]
    samples = [
        Sample(
            tokens=[1] + [2] * width,
            response_length=width,
            loss_mask=[int(m) for m in mask_T.tolist()],
            rollout_logprobs=[0.0] * width,
            reward=reward,
            group_index=group,
        )
        for reward, group, mask_T in zip(rewards, group_ids, mask_B_T, strict=True)
    ]
    micro = collate(train_items([samples], cfg), pad_token_id=0, device=CPU)
    if needs_advantage_pass(cfg):
        kl_B_T = torch.zeros_like(mask_B_T) if kl_B_T is None else kl_B_T
        set_token_advantages(cfg, micro, kl_B_T, values_B_T)
        if cfg.whiten_advantages:
            whiten_globally([micro], CPU)
    return micro


# ---------------------------------------------------------------- group estimators


def test_grpo_divides_by_the_unbiased_group_std() -> None:
    # group 7: [1, 3] mean 2 -> [-1, 1], unbiased std sqrt(2) -> [-0.7071068, 0.7071068]
    # group 2: [4] singleton -> 0
    # group 5: [0, 0, 3] mean 1 -> [-1, -1, 2], std sqrt(3)
    rewards, group_ids = [1.0, 4.0, 0.0, 3.0, 0.0, 3.0], [7, 2, 5, 7, 5, 5]
    r2, s3 = 0.70710678, 1.7320508
    expected = [-r2, 0.0, -1 / s3, r2, -1 / s3, 2 / s3]
    for name in ("grpo", "gspo"):
        micro = estimator_advantages(rewards, group_ids, torch.ones(6, 2), advantage_estimator=name)
        close(micro.advantages_B_T, [[a, a] for a in expected])
    micro = estimator_advantages(rewards, group_ids, torch.ones(6, 1), grpo_std_normalization=False)
    close(micro.advantages_B_T[:, 0], [-1.0, 0.0, -1.0, 1.0, -1.0, 2.0])


def test_dr_grpo_is_centered_never_divided() -> None:
    # group 7: [1, 3] mean 2 -> [-1, 1]; group 2: singleton -> 0; group 5: [0, 0, 3] mean 1
    micro = estimator_advantages(
        [1.0, 4.0, 0.0, 3.0, 0.0, 3.0],
        [7, 2, 5, 7, 5, 5],
        torch.ones(6, 1),
        advantage_estimator="dr_grpo",
    )
    close(micro.advantages_B_T[:, 0], [-1.0, 0.0, -1.0, 1.0, -1.0, 2.0])
    # all-equal rewards -> 0 for every estimator of the group family
    for name in ("grpo", "dr_grpo", "gspo", "reinforce_plus_plus_baseline"):
        micro = estimator_advantages([0.7] * 4, [0] * 4, torch.ones(4, 2), advantage_estimator=name)
        close(micro.advantages_B_T, [[0.0, 0.0]] * 4)


def test_group_advantages_std_eps_and_degenerate_groups() -> None:
    # [1, 2, 3]: std 1; [0, 0, 3]: std sqrt(3); eps lands in the denominator
    rewards_B = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 3.0])
    ids_B = torch.tensor([0, 0, 0, 1, 1, 1])
    s3 = 1.7320508
    close(
        group_advantages(rewards_B, ids_B, std_normalization=True, eps=0.0),
        [-1.0, 0.0, 1.0, -1 / s3, -1 / s3, 2 / s3],
    )
    close(
        group_advantages(rewards_B[:3], ids_B[:3], std_normalization=True, eps=1.0),
        [-0.5, 0.0, 0.5],
    )
    # singletons and equal rewards stay exactly 0, even with eps = 0
    for std in (True, False):
        singles_B = group_advantages(
            torch.tensor([5.0, -2.0]), torch.arange(2), std_normalization=std
        )
        close(singles_B, [0.0, 0.0])
        equal_B = torch.tensor([0.7, 0.7, 1.0, 1.0])
        out_B = group_advantages(equal_B, torch.tensor([0, 0, 1, 1]), std_normalization=std, eps=0)
        close(out_B, [0.0] * 4)


# ---------------------------------------------------------------- token rewards and returns


def test_terminal_token_rewards() -> None:
    # last masked-in token: row 0 -> t1, row 1 -> t2 (t1 masked), row 2 empty -> nowhere
    mask_B_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    close(
        terminal_token_rewards(torch.tensor([2.0, 5.0, 7.0]), mask_B_T),
        [[0.0, 2.0, 0.0], [0.0, 0.0, 5.0], [0.0, 0.0, 0.0]],
    )
    assert terminal_token_rewards(torch.tensor([1.0]), torch.zeros(1, 0)).shape == (1, 0)


def test_discounted_returns() -> None:
    # gamma 0.5 on [1, 2, 4]: G2 = 4, G1 = 2 + 0.5*4 = 4, G0 = 1 + 0.5*4 = 3
    rewards_B_T = torch.tensor([[1.0, 2.0, 4.0], [1.0, 100.0, 4.0]])
    full_B_T = torch.ones(2, 3)
    gap_B_T = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    close(discounted_returns(rewards_B_T[:1], full_B_T[:1], 0.5), [[3.0, 4.0, 4.0]])
    # a masked t1 drops its reward (100) and does not discount the chain: G0 = 1 + 0.5*4 = 3
    close(discounted_returns(rewards_B_T, gap_B_T, 0.5), [[3.0, 4.0, 4.0], [3.0, 0.0, 4.0]])
    # gamma 1 (the cumsum path): [7, 6, 4] and [5, 0, 4]
    close(discounted_returns(rewards_B_T, gap_B_T, 1.0), [[7.0, 6.0, 4.0], [5.0, 0.0, 4.0]])


def test_reinforce_plus_plus_with_kl_and_gamma() -> None:
    # kl_coef 0.5, gamma 0.5.
    # row 0: token rewards [-0.05, -0.1, -0.2 + 1] -> G2 = 0.8, G1 = -0.1 + 0.4 = 0.3,
    #        G0 = -0.05 + 0.15 = 0.1
    # row 1 (t1 masked): [-0.1, -, -0.1 + 2] -> G2 = 1.9, G0 = -0.1 + 0.95 = 0.85
    # row 2 empty -> 0
    kl_B_T = torch.tensor([[0.1, 0.2, 0.4], [0.2, 9.0, 0.2], [1.0, 1.0, 1.0]])
    mask_B_T = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    micro = estimator_advantages(
        [1.0, 2.0, 3.0],
        [0, 1, 2],
        mask_B_T,
        kl_B_T,
        advantage_estimator="reinforce_plus_plus",
        kl_coef=0.5,
        gamma=0.5,
        normalize_advantages=False,
    )
    close(micro.advantages_B_T, [[0.1, 0.3, 0.8], [0.85, 0.0, 1.9], [0.0, 0.0, 0.0]])


def test_reinforce_plus_plus_baseline() -> None:
    # group 0: [1, 3] mean 2 -> [-1, 1]; group 1: singleton -> 0; then minus 0.5*kl per token
    # row 0: [-1 - 0.1, -1 - 0.2]; row 1: [1 - 0, masked]; row 2: [0 - 0.5, 0 - 0.5]
    micro = estimator_advantages(
        [1.0, 3.0, 5.0],
        [0, 0, 1],
        torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]),
        torch.tensor([[0.2, 0.4], [0.0, 0.2], [1.0, 1.0]]),
        advantage_estimator="reinforce_plus_plus_baseline",
        kl_coef=0.5,
        normalize_advantages=False,
    )
    close(micro.advantages_B_T, [[-1.1, -1.2], [1.0, 0.0], [-0.5, -0.5]])


def test_reinforce_plus_plus_variants_are_whitened_by_default() -> None:
    # advantages [1, 3] (one token each): mean 2, unbiased std sqrt(2) -> ±0.7071068
    for name, group_ids in (
        ("reinforce_plus_plus", [0, 1]),
        ("reinforce_plus_plus_baseline", [0, 0]),
    ):
        micro = estimator_advantages(
            [1.0, 3.0], group_ids, torch.ones(2, 1), advantage_estimator=name
        )
        # a micro-batch is at least two tokens wide; the padded column is masked out
        assert micro.loss_mask_B_T[:, 1:].sum() == 0
        close(micro.advantages_B_T[:, :1], [[-0.7071068], [0.7071068]])


# ---------------------------------------------------------------- GAE


def test_gae_one_sequence() -> None:
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72), V = [0.5, 0.6, 0.7], r = [0, 0, 1], V_3 = 0
    # d2 = 1 - 0.7 = 0.3                 A2 = 0.3
    # d1 = 0.9*0.7 - 0.6 = 0.03           A1 = 0.03 + 0.72*0.3 = 0.246
    # d0 = 0.9*0.6 - 0.5 = 0.04           A0 = 0.04 + 0.72*0.246 = 0.21712
    adv_B_T, ret_B_T = gae(
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 0.6, 0.7]]),
        torch.ones(1, 3),
        gamma=0.9,
        lam=0.8,
    )
    close(adv_B_T, [[0.21712, 0.246, 0.3]])
    close(ret_B_T, [[0.71712, 0.846, 1.0]])


def test_gae_masked() -> None:
    # row 0, t2 padding: d1 = 1 - 0.6 = 0.4, A1 = 0.4; d0 = 0.9*0.6 - 0.5 = 0.04,
    #   A0 = 0.04 + 0.72*0.4 = 0.328; returns [0.828, 1.0, 0]
    # row 1, t1 masked (skipped, its 99s ignored): d2 = 1 - 0.4 = 0.6, A2 = 0.6;
    #   d0 = 0.5 + 0.9*0.4 - 0.2 = 0.66, A0 = 0.66 + 0.72*0.6 = 1.092; returns [1.292, 0, 1.0]
    # row 2 empty -> all 0
    rewards_B_T = torch.tensor([[0.0, 1.0, 7.0], [0.5, 99.0, 1.0], [1.0, 1.0, 1.0]])
    values_B_T = torch.tensor([[0.5, 0.6, 7.0], [0.2, 99.0, 0.4], [1.0, 1.0, 1.0]])
    mask_B_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    adv_B_T, ret_B_T = gae(rewards_B_T, values_B_T, mask_B_T, gamma=0.9, lam=0.8)
    close(adv_B_T, [[0.328, 0.4, 0.0], [1.092, 0.0, 0.6], [0.0, 0.0, 0.0]])
    close(ret_B_T, [[0.828, 1.0, 0.0], [1.292, 0.0, 1.0], [0.0, 0.0, 0.0]])


def test_ppo_is_gae_on_the_terminal_reward_minus_kl() -> None:
    # the one-sequence case above through the ppo estimator: r = 1 on the last token
    micro = estimator_advantages(
        [1.0],
        [0],
        torch.ones(1, 3),
        values_B_T=torch.tensor([[0.5, 0.6, 0.7]]),
        advantage_estimator="ppo",
        gamma=0.9,
        lam=0.8,
    )
    close(micro.advantages_B_T, [[0.21712, 0.246, 0.3]])
    close(micro.returns_B_T, [[0.71712, 0.846, 1.0]])
    close(micro.old_values_B_T, [[0.5, 0.6, 0.7]])
    # KL as reward, gamma = lam = 1, values 0: token rewards [-0.1, -0.1, 2 - 0.1]
    # -> advantages = returns = reward-to-go [1.7, 1.8, 1.9]
    micro = estimator_advantages(
        [2.0],
        [0],
        torch.ones(1, 3),
        torch.full((1, 3), 0.2),
        torch.zeros(1, 3),
        advantage_estimator="ppo",
        kl_coef=0.5,
    )
    close(micro.advantages_B_T, [[1.7, 1.8, 1.9]])
    close(micro.returns_B_T, [[1.7, 1.8, 1.9]])


def test_gae_lambda_one_returns_are_discounted_returns() -> None:
    torch.manual_seed(0)
    rewards_B_T = torch.randn(3, 6)
    values_B_T = torch.randn(3, 6)
    mask_B_T = (torch.rand(3, 6) > 0.3).float()
    _, ret_B_T = gae(rewards_B_T, values_B_T, mask_B_T, gamma=0.9, lam=1.0)
    torch.testing.assert_close(ret_B_T, discounted_returns(rewards_B_T, mask_B_T, 0.9))


# ---------------------------------------------------------------- whitening


def test_masked_whiten() -> None:
    # entries 1, 2, 3, 4 (the 100s are padding): mean 2.5, squares 2.25 + 0.25 + 0.25 + 2.25 = 5,
    # unbiased var 5/3, std 1.2909944 -> ±1.5/std = ±1.1618950, ±0.5/std = ±0.3872983
    x_B_T = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 100.0]])
    mask_B_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    a, b = 1.1618950, 0.3872983
    (out_B_T,) = masked_whiten([x_B_T], [mask_B_T], CPU)
    close(out_B_T, [[-a, -b, 0.0], [b, a, 0.0]])
    # split into micro-batches, the statistics are still those of the whole batch
    first_B_T, second_B_T = masked_whiten([x_B_T[:1], x_B_T[1:]], [mask_B_T[:1], mask_B_T[1:]], CPU)
    close(first_B_T, [[-a, -b, 0.0]])
    close(second_B_T, [[b, a, 0.0]])


def test_edge_cases_give_zeros_not_nan() -> None:
    empty_B_T = torch.zeros(2, 3)
    x_B_T = torch.ones(2, 3)
    rewards_B = torch.tensor([1.0, 2.0])
    baseline = estimator_advantages(
        [1.0, 2.0],
        [0, 1],
        empty_B_T,
        x_B_T,
        advantage_estimator="reinforce_plus_plus_baseline",
        kl_coef=0.1,
    )
    outs = [
        *masked_whiten([x_B_T], [empty_B_T], CPU),
        # one entry: nothing to scale by
        *masked_whiten([x_B_T], [torch.tensor([[1.0, 0, 0], [0, 0, 0]])], CPU),
        discounted_returns(x_B_T, empty_B_T, 0.9),
        reinforce_plus_plus_advantages(rewards_B, x_B_T, empty_B_T, kl_coef=0.1, gamma=0.9),
        baseline.advantages_B_T,
        *gae(x_B_T, x_B_T, empty_B_T, gamma=0.9, lam=0.9),
    ]
    for out in outs:
        close(out, [[0.0] * 3] * 2)
