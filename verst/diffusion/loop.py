"""The diffusion loop (`verst train` with `model.kind: diffusion`): rollout → reward → train → sync.

Each step draws `rollout.prompts_per_step` captions, samples `rollout.n_samples_per_prompt`
trajectories of each (seeds differ per sample), scores them, normalises rewards within each
group, and trains the chosen steps. The engine shares the trainer's model, so a sync is a
weight-version bump. Evaluation samples every caption with held-out noise seeds by the ODE and
logs `eval/reward_mean`; `samples_step{N}.png` holds those samples (one row per caption).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from verst.config import RunConfig, dump_config
from verst.diffusion import model as tiny
from verst.diffusion import objectives, remote, shapes
from verst.diffusion.engine import DiffusionEngine, DiffusionRequest, Trajectory
from verst.diffusion.grid import save_grid
from verst.diffusion.rewards import ImageReward, load_reward
from verst.diffusion.server import DiffusionClient
from verst.diffusion.trainer import DiffusionTrainer
from verst.fleet.launcher import LocalEngine
from verst.monitor.metrics import MetricsLogger
from verst.monitor.timer import PhaseTimer
from verst.rundir import check_writable
from verst.train.checkpoint import checkpoint_dir

EVAL_SEED_BASE = 10**9  # evaluation seeds never meet the training seeds below it


@dataclass
class DiffusionRun:
    cfg: RunConfig
    engine: DiffusionEngine | DiffusionClient
    trainer: DiffusionTrainer
    reward: ImageReward
    model_dir: Path
    run_dir: Path
    image_size: int
    server: LocalEngine | None = None  # the served engine's process, for engine=http

    def sync(self) -> None:
        """The next weight version to the engine: a bump in process, a disk push over HTTP."""
        version = self.engine.weight_version + 1
        if isinstance(self.engine, DiffusionClient):
            remote.push(self.trainer.model, self.engine, self.run_dir, version)
        else:
            self.engine.set_weight_version(version)


def build(cfg: RunConfig, run_dir: Path) -> DiffusionRun:
    device = torch.device(
        "cuda" if cfg.trainer.device != "cpu" and torch.cuda.is_available() else "cpu"
    )
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    assert cfg.model.path is not None  # RunConfig requires it for model.kind=diffusion
    model, meta = tiny.load(cfg.model.path, device)
    reward = load_reward(cfg.diffusion.reward, cfg.diffusion.clip_path)
    trainer = DiffusionTrainer(model, cfg.diffusion, cfg.trainer, device, cfg.seed)
    size = meta["image_size"]
    if cfg.diffusion.engine == "http":
        server, client = remote.launch(cfg.model.path, run_dir, device)
        return DiffusionRun(
            cfg, client, trainer, reward, Path(cfg.model.path), run_dir, size, server
        )
    engine = DiffusionEngine(model, size, device)
    return DiffusionRun(cfg, engine, trainer, reward, Path(cfg.model.path), run_dir, size)


def train_steps(cfg: RunConfig, step: int) -> list[int]:
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


def requests_for(cfg: RunConfig, step: int, record: list[int]) -> list[DiffusionRequest]:
    """`prompts_per_step` groups of `n_samples_per_prompt` requests, prompt-major."""
    d, r = cfg.diffusion, cfg.rollout
    generator = torch.Generator().manual_seed(cfg.seed * 7 + step)
    picks = torch.randint(0, len(shapes.CAPTIONS), (r.prompts_per_step,), generator=generator)
    base = (cfg.seed * 100_000 + step) * r.prompts_per_step * r.n_samples_per_prompt
    sde_type = d.sde_type
    return [
        DiffusionRequest(
            shapes.CAPTIONS[int(p)],
            d.negative_prompt,
            d.num_inference_steps,
            d.guidance_scale,
            seed=base + g * r.n_samples_per_prompt + k,
            sde_type=sde_type,
            noise_level=d.noise_level,
            record_steps=record if sde_type != "ode" else [],
        )
        for g, p in enumerate(picks)
        for k in range(r.n_samples_per_prompt)
    ]


def score(run: DiffusionRun, trajectories: list[Trajectory]) -> torch.Tensor:
    images = torch.stack([t.image for t in trajectories])
    rewards = run.reward(images, [t.request.prompt for t in trajectories])
    if len(rewards) != len(trajectories):
        raise ValueError(
            f"diffusion.reward returned {len(rewards)} scores for {len(trajectories)} images"
        )
    for t, value in zip(trajectories, rewards, strict=True):
        t.reward = float(value)
    return torch.tensor(rewards, dtype=torch.float32)


def evaluate(run: DiffusionRun, step: int) -> dict[str, float]:
    """Mean reward of every caption under held-out seeds (ODE sampling); saves the grid."""
    d = run.cfg.diffusion
    requests = [
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
    trajectories = run.engine.generate(requests)
    rewards = score(run, trajectories)
    save_grid(
        torch.stack([t.image for t in trajectories]),
        len(shapes.CAPTIONS),
        run.run_dir / f"samples_step{step}.png",
    )
    return {"eval/reward_mean": float(rewards.mean()), "eval/reward_std": float(rewards.std())}


def rl_step(run: DiffusionRun, step: int) -> dict[str, float]:
    cfg, timer = run.cfg, PhaseTimer(step=step)
    chosen = train_steps(cfg, step)
    with timer("rollout"):
        trajectories = run.engine.generate(requests_for(cfg, step, chosen))
    with timer("reward"):
        rewards = score(run, trajectories)
    with timer("advantages"):
        rewards_P_G = rewards.view(cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt)
        advantages = objectives.group_advantages(rewards_P_G, cfg.diffusion.adv_clip_max).flatten()
    with timer("train"):
        metrics = run.trainer.step(trajectories, advantages, chosen, step=step)
    with timer("sync"):
        run.sync()
    metrics |= {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()),
        "train/trained_steps": float(len(chosen)),
    }
    return metrics | timer.metrics(step_phases=("rollout", "reward", "advantages", "train", "sync"))


def sft_step(
    run: DiffusionRun, step: int, data: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, float]:
    cfg, timer = run.cfg, PhaseTimer(step=step)
    images, labels = data
    batch = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    idx = torch.randint(
        0, len(labels), (batch,), generator=torch.Generator().manual_seed(cfg.seed + step)
    )
    with timer("train"):
        metrics = run.trainer.sft_step(images[idx] * 2 - 1, labels[idx], step)
    run.sync()
    return metrics | timer.metrics(step_phases=("train",))


def save_checkpoint(run: DiffusionRun, step: int) -> Path:
    """A model directory (usable as model.path) plus the optimizer's state."""
    target = checkpoint_dir(run.run_dir, step)
    target.mkdir(parents=True, exist_ok=True)
    run.trainer.model.save_pretrained(target / "transformer")
    for name in ("scheduler", tiny.META_FILE):
        source = run.model_dir / name
        if source.is_dir():
            shutil.copytree(source, target / name, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy2(source, target / name)
    torch.save(run.trainer.optimizer.state_dict(), target / "optimizer.pt")
    (target / "step.json").write_text(
        json.dumps({"step": step, "weight_version": run.engine.weight_version})
    )
    return target


def train(cfg: RunConfig, run_dir: Path, *, resume: bool = False) -> Path:
    if resume:
        raise ValueError(
            "--resume: diffusion runs do not resume yet; start from a checkpoint "
            "directory as model.path instead"
        )
    check_writable(run_dir)
    run = build(cfg, run_dir)
    try:
        _run(cfg, run, run_dir)
    finally:
        if run.server is not None:
            run.server.stop()
    return run_dir


def _run(cfg: RunConfig, run: DiffusionRun, run_dir: Path) -> None:
    data = (
        shapes.dataset(cfg.diffusion.sft_dataset_size, run.image_size, cfg.seed)
        if cfg.diffusion.algorithm == "sft"
        else None
    )
    interval = cfg.diffusion.eval_interval_steps
    with MetricsLogger(
        run_dir,
        cfg.num_steps,
        start_step=0,
        monitor=cfg.monitor,
        config=cfg.model_dump(mode="json"),
    ) as log:
        dump_config(cfg, run_dir / "config.yaml")
        log.log({"step": 0, "weight_version": 0} | evaluate(run, 0))
        for step in range(1, cfg.num_steps + 1):
            metrics = sft_step(run, step, data) if data is not None else rl_step(run, step)
            last = step == cfg.num_steps
            if last or (interval and step % interval == 0):
                metrics |= evaluate(run, step)
            every = cfg.checkpoint.interval_steps
            if last or (every and step % every == 0):
                save_checkpoint(run, step)
            log.log({"step": step, "weight_version": run.engine.weight_version} | metrics)
        log.info(f"done: {cfg.num_steps} steps; samples and checkpoints in {run_dir}")
