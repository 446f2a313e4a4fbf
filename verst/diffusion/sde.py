"""Rectified-flow samplers in closed form: the ODE step, Flow-SDE and CPS, with log-probs.

Time runs from t = 1 (noise) to t = 0 (data) on `time_grid(n)`; x_t = (1 - t) x0 + t eps and
the model predicts the velocity v = eps - x0. A step goes from t to t_next < t (dt < 0):

- ode: x' = x + v dt (deterministic; eta must be 0).
- flow_sde (Flow-GRPO): sigma_t = eta sqrt(t / (1 - t)); the mean is
  x (1 + sigma_t^2 dt / (2t)) + v (1 + sigma_t^2 (1 - t) / (2t)) dt and the noise's std is
  sigma_t sqrt(-dt). At t = 1 the denominator's t is the grid's second point, as Flow-GRPO does.
- cps (coefficients-preserving): std = t_next sin(eta pi / 2); the mean is
  x0_hat (1 - t_next) + eps_hat sqrt(t_next^2 - std^2), which keeps the marginal's coefficients.

A transition's log-prob is the Gaussian log-density of x' averaged over its elements (Flow-GRPO's
convention), so it is comparable across image sizes.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

SdeType = Literal["flow_sde", "cps", "ode"]
SDE_TYPES: tuple[str, ...] = ("flow_sde", "cps", "ode")


def time_grid(num_steps: int) -> torch.Tensor:
    """The `num_steps + 1` times from 1 down to 0, evenly spaced (float64 for exact replay)."""
    if num_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_steps}")
    return torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)


def check_sde(sde_type: str, noise_level: float, *, field: str = "sde_type") -> None:
    """Refuse an unknown SDE type or a noise level that does not fit it (errors name `field`)."""
    if sde_type not in SDE_TYPES:
        raise ValueError(f"{field}: unknown SDE type {sde_type!r}; known: {', '.join(SDE_TYPES)}")
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    if sde_type == "ode" and noise_level != 0:
        raise ValueError(f"{field}=ode is deterministic: noise_level must be 0, got {noise_level}")
    if sde_type != "ode" and noise_level == 0:
        raise ValueError(f"{field}={sde_type} with noise_level=0 injects no noise: use ode")


def step_std(sde_type: str, noise_level: float, grid: torch.Tensor, index: int) -> float:
    """The std of the noise the step `index` (from grid[index] to grid[index + 1]) adds."""
    t, t_next = float(grid[index]), float(grid[index + 1])
    if sde_type == "ode":
        return 0.0
    if sde_type == "flow_sde":
        t_den = float(grid[1]) if t == 1.0 else t
        sigma_t = noise_level * math.sqrt(t / (1.0 - t_den))
        return sigma_t * math.sqrt(t - t_next)
    return t_next * math.sin(noise_level * math.pi / 2)


def step_mean(
    sde_type: str,
    noise_level: float,
    grid: torch.Tensor,
    index: int,
    x_B: torch.Tensor,
    v_B: torch.Tensor,
) -> torch.Tensor:
    """The mean of x_{t_next} given x_t = `x_B` and the velocity `v_B` (batched, any shape)."""
    t, t_next = float(grid[index]), float(grid[index + 1])
    dt = t_next - t
    if sde_type == "ode":
        return x_B + v_B * dt
    if sde_type == "flow_sde":
        t_den = float(grid[1]) if t == 1.0 else t
        sigma_t = noise_level * math.sqrt(t / (1.0 - t_den))
        drift = sigma_t**2 / (2 * t)
        return x_B * (1 + drift * dt) + v_B * (1 + drift * (1 - t)) * dt
    std = step_std(sde_type, noise_level, grid, index)
    x0_hat = x_B - t * v_B
    eps_hat = x_B + (1 - t) * v_B
    return x0_hat * (1 - t_next) + eps_hat * math.sqrt(max(t_next**2 - std**2, 0.0))


def transition_log_prob(x_next_B: torch.Tensor, mean_B: torch.Tensor, std: float) -> torch.Tensor:
    """Per-sample Gaussian log-density of `x_next_B` under N(mean, std^2), element-averaged."""
    if std <= 0:
        raise ValueError("a deterministic step (std 0) has no transition log-prob")
    z = (x_next_B - mean_B) / std
    log_density = -0.5 * z * z - math.log(std) - 0.5 * math.log(2 * math.pi)
    return log_density.flatten(1).mean(dim=1)


def check_recorded_steps(
    steps: list[int], num_steps: int, sde_type: str, noise_level: float, *, field: str
) -> None:
    """Refuse recorded step indices outside the grid or on a step that adds no noise."""
    grid = time_grid(num_steps)
    for index in steps:
        if not 0 <= index < num_steps:
            raise ValueError(f"{field}: step index {index} is outside 0..{num_steps - 1}")
        if step_std(sde_type, noise_level, grid, index) <= 0:
            raise ValueError(
                f"{field}: step {index} adds no noise under sde_type={sde_type} "
                f"(noise_level={noise_level}), so it has no log-prob to record"
            )
