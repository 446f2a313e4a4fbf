"""What a diffusion step asks the engine for: the steps it trains and its requests.

Everything here is a pure function of the config, the seed and a step (or, fully asynchronous,
a group's draw number), so a resumed run asks for exactly what the uninterrupted one would.
"""

from __future__ import annotations

import torch

from verst.config import RunConfig
from verst.diffusion import objectives, shapes
from verst.diffusion.engine import DiffusionRequest


def train_steps(cfg: RunConfig, step: int) -> list[int]:
    """The denoising steps trained at `step` (`diffusion.step_strategy`)."""
    d = cfg.diffusion
    if d.step_strategy == "sde_window":
        return objectives.sde_window(
            d.num_inference_steps, d.sde_window_size, d.sde_window_range, cfg.seed * 100_003 + step
        )
    low, high = d.sde_window_range
    allowed = list(range(low, high))
    return objectives.epoch_global_random_choice(
        d.num_inference_steps, d.train_steps_per_trajectory, cfg.seed, step, allowed=allowed
    )


def request(cfg: RunConfig, caption: str, seed: int, record: list[int]) -> DiffusionRequest:
    """One rollout request; the recorded (stochastic) steps are the trained ones."""
    d = cfg.diffusion
    return DiffusionRequest(
        caption,
        d.negative_prompt,
        d.num_inference_steps,
        d.guidance_scale,
        seed=seed,
        sde_type=d.sde_type,
        noise_level=d.noise_level,
        record_steps=record if d.sde_type != "ode" else [],
    )


def draw_captions(cfg: RunConfig, n: int, draw: int) -> list[str]:
    """`n` captions drawn at random under the seed and `draw` (a step or a group's number)."""
    generator = torch.Generator().manual_seed(cfg.seed * 7 + draw)
    picks = torch.randint(0, len(shapes.CAPTIONS), (n,), generator=generator)
    return [shapes.CAPTIONS[int(p)] for p in picks]


def requests_for(cfg: RunConfig, step: int, record: list[int]) -> list[DiffusionRequest]:
    """`prompts_per_step` groups of `n_samples_per_prompt` requests, prompt-major."""
    r = cfg.rollout
    base = (cfg.seed * 100_000 + step) * r.prompts_per_step * r.n_samples_per_prompt
    return [
        request(cfg, caption, base + g * r.n_samples_per_prompt + k, record)
        for g, caption in enumerate(draw_captions(cfg, r.prompts_per_step, step))
        for k in range(r.n_samples_per_prompt)
    ]
