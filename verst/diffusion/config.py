"""The `diffusion:` config section: algorithm, sampler, step strategy, reward and evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from verst.configbase import ConfigBase
from verst.diffusion.sde import check_sde


class DiffusionConfig(ConfigBase):
    algorithm: Literal["flow_grpo", "nft", "sft"] = Field(
        "flow_grpo",
        description="flow_grpo = clipped ratio over SDE transitions; nft = DiffusionNFT's "
        "forward-process objective; sft = flow matching on the procedural shapes",
    )
    num_inference_steps: int = Field(10, ge=1, description="denoising steps per trajectory")
    sde_type: Literal["flow_sde", "cps", "ode"] = Field(
        "flow_sde", description="sampler of the trained steps (ode: eta = 0, nft only)"
    )
    noise_level: float = Field(0.7, ge=0, description="eta of the SDE (0 for ode)")
    guidance_scale: float = Field(1.0, ge=0, description="classifier-free guidance; 1 = off")
    negative_prompt: str = Field(
        "", description="the guidance's negative prompt ('' = unconditional)"
    )
    step_strategy: Literal["sde_window", "epoch_global_random_choice"] = Field(
        "sde_window",
        description="which steps train: a random contiguous window, or a random set per epoch",
    )
    sde_window_size: int = Field(3, ge=1, description="steps in the SDE window")
    sde_window_range: tuple[int, int] = Field(
        (0, 6), description="the window lies within these step indices [start, end)"
    )
    train_steps_per_trajectory: int = Field(
        3, ge=1, description="steps chosen per epoch by epoch_global_random_choice"
    )
    adv_clip_max: float = Field(5.0, gt=0, description="advantages are clamped to +-this")
    clip_range: float = Field(1e-3, gt=0, description="Flow-GRPO's ratio clip epsilon")
    kl_beta: float = Field(0.0, ge=0, description="weight of the KL to the initial model; 0 = off")
    nft_beta: float = Field(1.0, gt=0, description="DiffusionNFT's beta (branch strength)")
    updates_per_step: int = Field(1, ge=1, description="optimizer steps per batch of rollouts")
    micro_batch: int = Field(64, ge=1, description="transitions per forward/backward")
    reward: str = Field(
        "shape_colour",
        description="image reward: shape_colour, clip (needs clip_path) or 'pkg.mod:fn'",
    )
    clip_path: str | None = Field(None, description="local CLIP directory for reward=clip")
    engine: Literal["in_process", "http"] = Field(
        "in_process",
        description="in_process = the trainer's own model (a sync is a version bump); http = a "
        "`verst serve-diffusion` subprocess updated through the disk or, with "
        "sync.transport=broadcast, a torch.distributed group",
    )
    engine_device: str | None = Field(
        None,
        description="device of the served engine (engine=http): cpu, cuda or cuda:N; unset = the "
        "trainer's; on another GPU a broadcast push goes through NCCL, else gloo",
    )
    eval_interval_steps: int = Field(5, ge=0, description="evaluate every N steps; 0 = start/end")
    eval_seeds_per_prompt: int = Field(
        4, ge=1, description="held-out noise seeds per caption at evaluation (ODE sampling)"
    )
    sft_dataset_size: int = Field(768, ge=1, description="procedural images for algorithm=sft")

    @model_validator(mode="after")
    def _check(self) -> DiffusionConfig:
        check_sde(self.sde_type, self.noise_level, field="diffusion.sde_type")
        if self.algorithm == "flow_grpo" and self.sde_type == "ode":
            raise ValueError(
                "diffusion.sde_type=ode has no transition log-probs; Flow-GRPO needs flow_sde or "
                "cps (eta > 0); use algorithm=nft for ODE sampling"
            )
        if self.engine_device is not None and self.engine != "http":
            raise ValueError(
                "diffusion.engine_device places a served engine; with diffusion.engine="
                f"{self.engine} the engine runs on the trainer's device"
            )
        if self.reward == "clip" and self.clip_path is None:
            raise ValueError("diffusion.reward=clip needs diffusion.clip_path")
        low, high = self.sde_window_range
        if not 0 <= low < high <= self.num_inference_steps:
            raise ValueError(
                f"diffusion.sde_window_range {[low, high]} must lie in "
                f"0..{self.num_inference_steps}"
            )
        return self
