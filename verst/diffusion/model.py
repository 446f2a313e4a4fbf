"""The tiny class-conditioned rectified-flow DiT: build, pre-train, save and load with diffusers.

`create_tiny_diffusion(DIR)` writes `DIR/transformer` (a `diffusers.DiTTransformer2DModel`
saved with `save_pretrained`), `DIR/scheduler` (the matching `FlowMatchEulerDiscreteScheduler`,
for the plain diffusers sampling loop) and `DIR/verst_diffusion.json` (captions, image size).
Pixel space: the model sees RGB in [-1, 1]. The velocity is v = eps - x0 (see `sde.py`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verst.diffusion import shapes

META_FILE = "verst_diffusion.json"
TIMESTEP_SCALE = 1000.0  # DiT's sinusoidal embedding expects timesteps in [0, 1000]


@dataclass
class TinyDiffusionSpec:
    image_size: int = 16
    patch_size: int = 2
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 2


def build_model(spec: TinyDiffusionSpec, seed: int) -> torch.nn.Module:
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    return DiTTransformer2DModel(
        num_attention_heads=spec.num_heads,
        attention_head_dim=spec.hidden_size // spec.num_heads,
        in_channels=3,
        out_channels=3,
        num_layers=spec.num_layers,
        sample_size=spec.image_size,
        patch_size=spec.patch_size,
        num_embeds_ada_norm=shapes.NULL_CLASS,  # the label table has one more row: the null class
    )


def velocity(
    model: torch.nn.Module,
    x_B: torch.Tensor,
    t_B: torch.Tensor,
    labels_B: torch.Tensor,
    negative_B: torch.Tensor,
    guidance_B: torch.Tensor,
) -> torch.Tensor:
    """The guided velocity v_neg + g (v_cond - v_neg); one forward when every g is 1."""
    timestep = (t_B * TIMESTEP_SCALE).to(x_B.dtype)
    if bool((guidance_B == 1).all()):
        return model(x_B, timestep=timestep, class_labels=labels_B).sample
    both = model(
        torch.cat([x_B, x_B]),
        timestep=torch.cat([timestep, timestep]),
        class_labels=torch.cat([labels_B, negative_B]),
    ).sample
    cond, neg = both.chunk(2)
    g = guidance_B.to(x_B.dtype).view(-1, *([1] * (x_B.dim() - 1)))
    return neg + g * (cond - neg)


def flow_matching_loss(
    model: torch.nn.Module, x0_B: torch.Tensor, labels_B: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Mean squared error of the predicted velocity at a uniform random time (SFT's loss)."""
    n = x0_B.shape[0]
    t = torch.rand(n, generator=generator).to(x0_B.device)
    eps = torch.randn(x0_B.shape, generator=generator).to(x0_B.device)
    tt = t.view(-1, 1, 1, 1)
    x_t = (1 - tt) * x0_B + tt * eps
    v = model(x_t, timestep=t * TIMESTEP_SCALE, class_labels=labels_B).sample
    return ((v - (eps - x0_B)) ** 2).mean()


def pretrain(
    model: torch.nn.Module,
    spec: TinyDiffusionSpec,
    *,
    steps: int,
    seed: int,
    batch_size: int = 64,
    lr: float = 2e-3,
    log=print,
) -> float:
    """Flow-matching pre-training on procedural shapes; 10% of labels become the null class
    so guidance has an unconditional branch. Returns the last loss."""
    images, labels = shapes.dataset(max(batch_size * 16, 768), spec.image_size, seed)
    x0 = images * 2 - 1
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / max(steps, 1))
    model.eval()  # no dropout: the label drop below is explicit and seeded
    start, loss = time.monotonic(), torch.tensor(0.0)
    for step in range(steps):
        idx = torch.randint(0, x0.shape[0], (batch_size,), generator=generator)
        drop = torch.rand(batch_size, generator=generator) < 0.1
        batch_labels = torch.where(
            drop, torch.full_like(labels[idx], shapes.NULL_CLASS), labels[idx]
        )
        loss = flow_matching_loss(model, x0[idx], batch_labels, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if (step + 1) % max(steps // 10, 1) == 0:
            log(
                f"pre-train step {step + 1}/{steps}: loss {loss.item():.4f} "
                f"({time.monotonic() - start:.0f}s)"
            )
    return float(loss.item())


def save(model: torch.nn.Module, directory: Path, spec: TinyDiffusionSpec) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory / "transformer")
    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=int(TIMESTEP_SCALE), shift=1.0
    ).save_pretrained(directory / "scheduler")
    meta = {
        "image_size": spec.image_size,
        "captions": list(shapes.CAPTIONS),
        "null_class": shapes.NULL_CLASS,
    }
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def load(directory: str | Path, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, dict]:
    """The model (eval mode, float32) and its metadata; FileNotFoundError naming the directory."""
    from diffusers import DiTTransformer2DModel

    path = Path(directory).expanduser()
    if not (path / META_FILE).is_file() or not (path / "transformer").is_dir():
        what = "does not exist" if not path.exists() else f"has no {META_FILE} and transformer/"
        raise FileNotFoundError(
            f"model.path: diffusion model directory {str(path)!r} {what}; make one with "
            f"`verst model create-tiny-diffusion {directory}`"
        )
    meta = json.loads((path / META_FILE).read_text())
    if tuple(meta.get("captions", ())) != shapes.CAPTIONS:
        raise ValueError(f"model.path: {path} was made for other captions than this verst knows")
    model = DiTTransformer2DModel.from_pretrained(path / "transformer").to(device=device)
    return model.float().eval(), meta


def read_weights(transformer_dir: Path, *, field: str) -> dict[str, torch.Tensor]:
    """The tensors of a saved transformer directory; ValueError naming `field` when it has none."""
    from safetensors.torch import load_file

    files = sorted(transformer_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{field}: {transformer_dir} holds no safetensors")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state |= load_file(file)
    return state


def copy_parameters(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], *, field: str
) -> None:
    """Copy `tensors` (some of the model's parameters, by name) into `model`; every name and
    shape is checked before the first copy (ValueError naming `field`)."""
    own = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(own))
    if unknown:
        raise ValueError(f"{field}: unknown parameter names {unknown[:3]}")
    for name, tensor in tensors.items():
        if own[name].shape != tensor.shape:
            raise ValueError(
                f"{field}: {name} has shape {tuple(tensor.shape)}, the model's "
                f"{tuple(own[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in tensors.items():
            own[name].copy_(tensor)


def create_tiny_diffusion(
    directory: Path, spec: TinyDiffusionSpec, *, pretrain_steps: int, seed: int, log=print
) -> float:
    """Build, pre-train and save the tiny model; returns the last pre-training loss."""
    model = build_model(spec, seed)
    loss = (
        pretrain(model, spec, steps=pretrain_steps, seed=seed, log=log) if pretrain_steps else 0.0
    )
    save(model, directory, spec)
    return loss
