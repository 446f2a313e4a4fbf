"""Diffusion generation with recorded trajectories: the engine behind `/rollout/generate`.

`DiffusionEngine.generate(requests)` samples a batch of trajectories. Each request names its
prompt, negative prompt, steps, guidance, seed, SDE type, noise level and the step indices to
record; those steps are stochastic (the SDE) and the others are ODE steps, as in Flow-GRPO's SDE
window. A `Trajectory` carries the image, every latent x_0..x_n of the walk from noise to data,
the recorded steps' transition log-probs and the conditioning (class ids, guidance) that
replays the model's forward, so the trainer recomputes exactly the same transitions.

The engine holds the trainer's model object when they share a process and take turns (a weight
update is a version bump), or its own copy: fully asynchronous (`update_weights` copies the
trainer's weights in between two batches) or behind `verst serve-diffusion`. With LoRA the
update carries the adapters alone (`verst.diffusion.adapters`), applied on the engine's base.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verst.diffusion import adapters, sde, shapes
from verst.diffusion.model import copy_parameters, velocity


@dataclass
class DiffusionRequest:
    prompt: str
    negative_prompt: str = ""
    num_inference_steps: int = 10
    guidance_scale: float = 1.0
    seed: int = 0
    sde_type: str = "flow_sde"
    noise_level: float = 0.7
    record_steps: list[int] | None = None  # None: every step that adds noise (none for ode)

    def recorded(self) -> list[int]:
        """The validated recorded step indices (ValueError naming the field)."""
        sde.check_sde(self.sde_type, self.noise_level)
        if self.guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0, got {self.guidance_scale}")
        n = self.num_inference_steps
        grid = sde.time_grid(n)
        if self.record_steps is None:
            steps = [
                i for i in range(n) if sde.step_std(self.sde_type, self.noise_level, grid, i) > 0
            ]
        else:
            steps = sorted(set(self.record_steps))
        sde.check_recorded_steps(steps, n, self.sde_type, self.noise_level, field="record_steps")
        return steps


@dataclass
class Trajectory:
    request: DiffusionRequest
    latents: torch.Tensor  # (num_steps + 1, C, H, W): x at grid[0] = 1 (noise) .. grid[n] = 0
    record_steps: list[int]
    log_probs: torch.Tensor  # (len(record_steps),) float32
    label: int
    negative_label: int
    weight_version: int = 0
    reward: float | None = None
    extras: dict = field(default_factory=dict)

    @property
    def image(self) -> torch.Tensor:
        """The final sample as RGB in [0, 1], (3, H, W)."""
        return ((self.latents[-1] + 1) / 2).clamp(0, 1)


class DiffusionEngine:
    def __init__(self, model: torch.nn.Module, image_size: int, device: torch.device | str = "cpu"):
        self.model = model
        self.image_size = image_size
        self.device = torch.device(device)
        self.weight_version = 0
        self._lock = threading.Lock()  # a batch and a weight update never overlap

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy `state` (the whole model's, or with LoRA its adapters alone) into the engine's
        own model once the batch in flight has finished."""
        with self._lock, torch.no_grad():
            adapters.load_into(self.model, state, field="update_weights")
            self.weight_version = version

    def receive(self, tensors: dict[str, torch.Tensor], adapter_config: dict | None = None) -> None:
        """One bucket of a broadcast push, once the batch in flight has finished: some of the
        model's parameters, or with `adapter_config` (peft's keys) a whole adapter named as
        engines take it. The version stays: the push stamps it after its last bucket."""
        with self._lock:
            if adapter_config is None:
                copy_parameters(self.model, tensors, field="names")
            else:
                adapters.apply_wire(self.model, adapter_config, tensors, field="lora_config")

    def load_adapter(self, directory: Path, version: int) -> None:
        """Apply the peft directory `directory` to the engine's model (injecting the adapters
        into its base the first time) once the batch in flight has finished."""
        with self._lock:
            adapters.apply_dir(self.model, directory, field="lora_path")
            self.weight_version = version

    @torch.no_grad()
    def generate(
        self, requests: list[DiffusionRequest], *, max_batch: int = 64
    ) -> list[Trajectory]:
        """Trajectories for `requests`, in order; requests of equal steps are batched."""
        recorded = [r.recorded() for r in requests]
        out: list[Trajectory | None] = [None] * len(requests)
        by_steps: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_steps.setdefault(r.num_inference_steps, []).append(i)
        for indices in by_steps.values():
            for start in range(0, len(indices), max_batch):
                chunk = indices[start : start + max_batch]
                with self._lock:
                    batch = self._batch([requests[i] for i in chunk], [recorded[i] for i in chunk])
                for i, traj in zip(chunk, batch, strict=True):
                    out[i] = traj
        return [t for t in out if t is not None]

    def _batch(
        self, requests: list[DiffusionRequest], recorded: list[list[int]]
    ) -> list[Trajectory]:
        n, b = requests[0].num_inference_steps, len(requests)
        grid = sde.time_grid(n)
        generators = [torch.Generator().manual_seed(r.seed) for r in requests]
        shape = (3, self.image_size, self.image_size)
        x = torch.stack([torch.randn(shape, generator=g) for g in generators]).to(self.device)
        labels = torch.tensor(
            [shapes.caption_class(r.prompt) for r in requests], device=self.device
        )
        negative = torch.tensor(
            [shapes.caption_class(r.negative_prompt, field="negative_prompt") for r in requests],
            device=self.device,
        )
        guidance = torch.tensor([r.guidance_scale for r in requests], device=self.device)
        latents = [x.cpu()]
        log_probs: list[list[float]] = [[] for _ in requests]
        for i in range(n):
            t = torch.full((b,), float(grid[i]), device=self.device)
            v = velocity(self.model, x, t, labels, negative, guidance)
            x = self._advance(requests, recorded, grid, i, x, v, generators, log_probs)
            latents.append(x.cpu())
        stacked = torch.stack(latents, dim=1)  # (B, n + 1, C, H, W)
        return [
            Trajectory(
                r,
                stacked[j],
                recorded[j],
                torch.tensor(log_probs[j], dtype=torch.float32),
                int(labels[j]),
                int(negative[j]),
                self.weight_version,
            )
            for j, r in enumerate(requests)
        ]

    def _advance(self, requests, recorded, grid, i, x, v, generators, log_probs) -> torch.Tensor:
        """Each sample's step i: its SDE where it records step i, else the ODE (one batched
        step per sampler; each sample's noise from its own generator)."""
        nxt = sde.step_mean("ode", 0.0, grid, i, x, v)
        samplers: dict[tuple[str, float], list[int]] = {}
        for j, r in enumerate(requests):
            if i in recorded[j]:
                samplers.setdefault((r.sde_type, r.noise_level), []).append(j)
        for (sde_type, eta), rows in samplers.items():
            mean = sde.step_mean(sde_type, eta, grid, i, x[rows], v[rows])
            std = sde.step_std(sde_type, eta, grid, i)
            noise = torch.stack(
                [torch.randn(mean.shape[1:], generator=generators[j]) for j in rows]
            )
            sampled = mean + std * noise.to(mean.device)
            for j, logp in zip(
                rows, sde.transition_log_prob(sampled, mean, std).tolist(), strict=True
            ):
                log_probs[j].append(logp)
            nxt[rows] = sampled
        return nxt
