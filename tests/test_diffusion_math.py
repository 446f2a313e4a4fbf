"""Closed forms of the diffusion samplers and objectives, checked against hand computations."""

import math

import pytest
import torch

from verst.diffusion import objectives, sde


def test_time_grid_runs_from_noise_to_data():
    assert sde.time_grid(4).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_flow_sde_std_matches_sigma_t():
    grid = sde.time_grid(4)
    # t = 0.75: sigma_t = 0.7 sqrt(0.75 / 0.25), times sqrt(-dt) = sqrt(0.25)
    assert sde.step_std("flow_sde", 0.7, grid, 1) == pytest.approx(0.7 * math.sqrt(3) * 0.5)
    # t = 1 divides by 1 - grid[1] instead of 0
    assert sde.step_std("flow_sde", 0.7, grid, 0) == pytest.approx(0.7 * 2 * 0.5)
    assert sde.step_std("ode", 0.0, grid, 1) == 0.0
    assert sde.step_std("cps", 0.5, grid, 1) == pytest.approx(0.5 * math.sin(math.pi / 4))


def test_flow_sde_mean_by_hand():
    grid = sde.time_grid(4)
    x, v = torch.tensor([[2.0]]), torch.tensor([[-1.0]])
    t, dt, sigma2 = 0.5, -0.25, (0.7**2) * (0.5 / 0.5)
    expected = 2.0 * (1 + sigma2 * dt / (2 * t)) + (-1.0) * (1 + sigma2 * (1 - t) / (2 * t)) * dt
    assert float(sde.step_mean("flow_sde", 0.7, grid, 2, x, v)) == pytest.approx(expected)


def test_ode_and_cps_follow_the_straight_path():
    grid = sde.time_grid(4)
    x0, eps = torch.tensor([[0.3, -0.8]]), torch.tensor([[1.2, 0.4]])
    t, t_next = 0.75, 0.5
    x_t, v = (1 - t) * x0 + t * eps, eps - x0
    ode = sde.step_mean("ode", 0.0, grid, 1, x_t, v)
    torch.testing.assert_close(ode, (1 - t_next) * x0 + t_next * eps)
    std = sde.step_std("cps", 0.6, grid, 1)
    cps = sde.step_mean("cps", 0.6, grid, 1, x_t, v)
    torch.testing.assert_close(cps, (1 - t_next) * x0 + math.sqrt(t_next**2 - std**2) * eps)


def test_transition_log_prob_is_the_mean_gaussian_density():
    gen = torch.Generator().manual_seed(0)
    x, mean = torch.randn(3, 2, 4, 4, generator=gen), torch.randn(3, 2, 4, 4, generator=gen)
    expected = torch.distributions.Normal(mean, 0.37).log_prob(x).flatten(1).mean(1)
    torch.testing.assert_close(sde.transition_log_prob(x, mean, 0.37), expected)
    with pytest.raises(ValueError, match="no transition log-prob"):
        sde.transition_log_prob(x, mean, 0.0)


def test_bad_sde_settings_are_refused():
    with pytest.raises(ValueError, match="unknown SDE type 'ddim'"):
        sde.check_sde("ddim", 0.7)
    with pytest.raises(ValueError, match="noise_level must be 0"):
        sde.check_sde("ode", 0.5)
    with pytest.raises(ValueError, match="use ode"):
        sde.check_sde("flow_sde", 0.0)
    with pytest.raises(ValueError, match="step 3 adds no noise"):  # cps' last step is exact
        sde.check_recorded_steps([3], 4, "cps", 0.7, field="record_steps")
    with pytest.raises(ValueError, match="outside 0..3"):
        sde.check_recorded_steps([4], 4, "flow_sde", 0.7, field="record_steps")


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    adv = objectives.group_advantages(rewards, adv_clip_max=0.5)
    # group 1: mean 2, std 1 -> (-1, 1) / 1.0001, clamped to +-0.5; group 2: all zero
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.5], [0.0, 0.0]]))
    unclamped = objectives.group_advantages(rewards, adv_clip_max=5.0)
    assert float(unclamped[0, 1]) == pytest.approx(1 / 1.0001)


def test_flow_grpo_clip_by_hand():
    old = torch.zeros(3)
    new = torch.log(torch.tensor([1.5, 0.5, 1.05]))
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, extra = objectives.flow_grpo_loss(new, old, adv, clip_range=0.2)
    # max(-A r, -A clip(r)): (-1.5 vs -1.2) -> -1.2; (0.5 vs 0.8) -> 0.8; (-2.1 vs -2.1) -> -2.1
    assert float(loss) == pytest.approx((-1.2 + 0.8 - 2.1) / 3)
    assert extra["train/clip_frac"] == pytest.approx(2 / 3)


def test_gaussian_mean_kl_by_hand():
    new, ref = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]])
    kl = objectives.gaussian_mean_kl(new, ref, torch.tensor([0.5]))
    assert float(kl) == pytest.approx(((1 + 4) / 2) / (2 * 0.25))


def test_nft_r_bounds_and_branch_algebra():
    adv = torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 10.0])
    torch.testing.assert_close(objectives.nft_r(adv, 5.0), torch.tensor([0, 0, 0.5, 0.75, 1, 1.0]))
    v_new, v_old = torch.tensor([2.0]), torch.tensor([1.0])
    pos, neg = objectives.nft_branches(v_new, v_old, beta=0.5)
    assert float(pos) == pytest.approx(1.5) and float(neg) == pytest.approx(0.5)
    assert float(pos + neg) == pytest.approx(2 * float(v_old))  # symmetric about v_old


def test_nft_loss_by_hand():
    x0, eps, t = torch.tensor([[1.0, -1.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([0.5])
    x_t = 0.5 * x0 + 0.5 * eps
    v_old, v_new = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]], requires_grad=True)
    loss = objectives.nft_loss(
        x0, x_t, t, v_new, v_old, torch.tensor([2.5]), beta=1.0, adv_clip_max=5.0
    )
    pos_err = (x_t - 0.5 * torch.tensor([[1.0, 1.0]])) - x0  # v+ = v_new
    neg_err = (x_t - 0.5 * torch.tensor([[-1.0, -1.0]])) - x0  # v- = 2 v_old - v_new
    weighted = lambda e: float((e**2 / e.abs().mean()).mean())  # noqa: E731
    r = 0.75
    assert loss.item() == pytest.approx(5.0 * (r * weighted(pos_err) + (1 - r) * weighted(neg_err)))
    loss.backward()
    assert v_new.grad is not None and torch.isfinite(v_new.grad).all()


def test_step_strategies_under_a_seed():
    window = objectives.sde_window(10, 3, (0, 6), seed=7)
    assert window == objectives.sde_window(10, 3, (0, 6), seed=7)
    assert len(window) == 3 and window[0] >= 0 and window[-1] < 6
    assert window == list(range(window[0], window[0] + 3))
    starts = {objectives.sde_window(10, 3, (0, 6), seed=s)[0] for s in range(40)}
    assert starts == {0, 1, 2, 3}
    chosen = objectives.epoch_global_random_choice(10, 3, seed=1, epoch=2)
    assert chosen == objectives.epoch_global_random_choice(10, 3, seed=1, epoch=2)
    assert chosen == sorted(set(chosen)) and len(chosen) == 3
    epochs = {
        tuple(objectives.epoch_global_random_choice(10, 3, seed=1, epoch=e)) for e in range(5)
    }
    assert len(epochs) > 1
    assert set(objectives.epoch_global_random_choice(10, 2, 0, 0, allowed=[4, 5])) == {4, 5}
    with pytest.raises(ValueError, match="sde_window_range"):
        objectives.sde_window(10, 4, (0, 3), seed=0)
