"""Diffusion evaluation: every caption under held-out noise seeds, sampled by the ODE, scored by
`diffusion.reward`; during a run (`eval/reward_mean` every `diffusion.eval_interval_steps`, the
grid `samples_step{N}.png`) and on a saved checkpoint (`verst eval CHECKPOINT CONFIG` with
`model.kind: diffusion`: one row per caption and their mean, as the LM's `verst eval` prints
one per evaluation set).
"""

from __future__ import annotations

from pathlib import Path

import torch

from verst import distributed
from verst.diffusion import adapters, shapes
from verst.diffusion import model as tiny
from verst.diffusion.config import DiffusionConfig
from verst.diffusion.engine import DiffusionEngine, DiffusionRequest, Trajectory
from verst.diffusion.grid import save_grid
from verst.diffusion.rewards import ImageReward, load_reward
from verst.models.lora import is_adapter_dir

EVAL_SEED_BASE = 10**9  # evaluation seeds never meet the training seeds below it
ALL = "all"  # the table's row of every caption


def requests(d: DiffusionConfig) -> list[DiffusionRequest]:
    """Every caption with `d.eval_seeds_per_prompt` held-out seeds, caption by caption."""
    return [
        DiffusionRequest(
            c,
            d.negative_prompt,
            d.num_inference_steps,
            d.guidance_scale,
            seed=EVAL_SEED_BASE + s,
            sde_type="ode",
            noise_level=0.0,
            record_steps=[],
        )
        for c in shapes.CAPTIONS
        for s in range(d.eval_seeds_per_prompt)
    ]


def score(reward: ImageReward, trajectories: list[Trajectory]) -> torch.Tensor:
    """The rewards of `trajectories` (also stored on each); ValueError on a wrong count."""
    images = torch.stack([t.image for t in trajectories])
    rewards = reward(images, [t.request.prompt for t in trajectories])
    if len(rewards) != len(trajectories):
        raise ValueError(
            f"diffusion.reward returned {len(rewards)} scores for {len(trajectories)} images"
        )
    for t, value in zip(trajectories, rewards, strict=True):
        t.reward = float(value)
    return torch.tensor(rewards, dtype=torch.float32)


def evaluate(
    engine, reward: ImageReward, d: DiffusionConfig, grid: Path | None = None
) -> dict[str, float]:
    """`eval/reward_mean`, `eval/reward_std` and each caption's `eval/<caption>/reward_mean`
    (words joined by `_`); the samples as a grid PNG at `grid`, one row per caption."""
    trajectories = engine.generate(requests(d))
    rewards = score(reward, trajectories)
    if grid is not None:
        images = torch.stack([t.image for t in trajectories])
        save_grid(images, len(shapes.CAPTIONS), grid)
    per_caption = rewards.view(len(shapes.CAPTIONS), d.eval_seeds_per_prompt).mean(dim=1)
    metrics = {"eval/reward_mean": float(rewards.mean()), "eval/reward_std": float(rewards.std())}
    for caption, value in zip(shapes.CAPTIONS, per_caption.tolist(), strict=True):
        metrics[f"eval/{caption.replace(' ', '_')}/reward_mean"] = value
    return metrics


def load_checkpoint(checkpoint: Path, base: str | None, device: torch.device) -> tuple:
    """The model a checkpoint holds (or any model directory), and its metadata: a LoRA
    checkpoint's `adapter/` is applied to `base` (`model.path`)."""
    adapter = checkpoint / adapters.ADAPTER_DIR
    if not is_adapter_dir(adapter):
        return tiny.load(checkpoint, device)
    if base is None:
        raise ValueError(f"model.path: {checkpoint} holds LoRA adapters; name their base model")
    model, meta = tiny.load(base, device)
    adapters.apply_dir(model, adapter, field="checkpoint")
    return model, meta


def evaluate_checkpoint_dir(checkpoint: Path, cfg: object) -> dict[str, float]:
    """`cfg`'s (a `RunConfig` with `model.kind: diffusion`) evaluation on `checkpoint`."""
    device = distributed.resolve_device(cfg.trainer.device)  # type: ignore[attr-defined]
    model, meta = load_checkpoint(checkpoint, cfg.model.path, device)  # type: ignore[attr-defined]
    d: DiffusionConfig = cfg.diffusion  # type: ignore[attr-defined]
    engine = DiffusionEngine(model, meta["image_size"], device)
    return evaluate(engine, load_reward(d.reward, d.clip_path), d)


def format_table(metrics: dict[str, float]) -> str:
    """One row per caption and one for all of them: the mean reward."""
    rows = {
        key.removeprefix("eval/").removesuffix("/reward_mean").replace("_", " "): value
        for key, value in metrics.items()
        if key.endswith("/reward_mean") and key.count("/") == 2
    }
    rows[ALL] = metrics["eval/reward_mean"]
    width = max(len("caption"), *(len(name) for name in rows))
    lines = [f"{'caption':<{width}}  {'reward_mean':>12}"]
    lines += [f"{name:<{width}}  {value:>12.4g}" for name, value in rows.items()]
    return "\n".join(lines)
