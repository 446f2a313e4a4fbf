"""The diffusion loop (`verst train` with `model.kind: diffusion`): rollout → reward → train → sync.

Each step draws `rollout.prompts_per_step` captions, samples `rollout.n_samples_per_prompt`
trajectories of each (seeds differ per sample), scores them, normalises rewards within each
group, and trains the chosen steps. The in-process engine shares the trainer's model, so a
sync is a weight-version bump; a served one (`diffusion.engine: http`) gets the weights through
the disk or, with `sync.transport: broadcast`, the LM's broadcast transport (`remote`). With
`model.lora` the trainer trains adapters on the frozen transformer (`verst.diffusion.adapters`)
and every sync carries the adapters alone. Fully asynchronous (`mode: fully_async`), the engine
keeps weights of its own and never stops generating (`verst.diffusion.async_rollout`: the LM's
rollout worker and data buffer); each step takes one batch of finished groups
(`perf/wait_time_s`), trains, and copies the new weights into the engine. Evaluation samples
every caption with held-out noise seeds by the ODE and logs `eval/reward_mean`;
`samples_step{N}.png` holds those samples (one row per caption). Checkpoints are
`verst.diffusion.checkpoint`'s; `--resume` continues from the newest.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from verst.config import RunConfig, dump_config
from verst.diffusion import adapters, checkpoint, evaluation, objectives, remote, shapes
from verst.diffusion import model as tiny
from verst.diffusion.async_rollout import TRAIN_STEPS, TRAJECTORY, AsyncDiffusionRollout
from verst.diffusion.engine import DiffusionEngine, Trajectory
from verst.diffusion.requests import requests_for, train_steps
from verst.diffusion.rewards import ImageReward, load_reward
from verst.diffusion.server import DiffusionClient
from verst.diffusion.trainer import DiffusionTrainer
from verst.fleet.launcher import LocalEngine
from verst.models.lora import LoraConfig
from verst.monitor.metrics import MetricsLogger
from verst.monitor.timer import PhaseTimer
from verst.rundir import check_writable
from verst.train.checkpoint import due as checkpoint_due


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
    rollout: AsyncDiffusionRollout | None = None  # mode=fully_async
    lora: LoraConfig | None = None  # model.lora, when the trainer trains adapters
    broadcast: remote.BroadcastPush | None = None  # engine=http with sync.transport=broadcast

    def sync(self, version: int | None = None) -> int:
        """The trainer's weights (with LoRA, its adapters alone) to the engine as `version`
        (default: the next): a bump when they share the model, a copy into the engine's own,
        or a disk or broadcast push to the served engine. Returns the bytes sent."""
        version = self.engine.weight_version + 1 if version is None else version
        model = self.trainer.model
        if self.broadcast is not None:
            return self.broadcast.push(model, version)
        if isinstance(self.engine, DiffusionClient):
            return remote.push(model, self.engine, self.run_dir, version, self.lora)
        if self.engine.model is model:
            self.engine.set_weight_version(version)
            return 0
        state = adapters.adapter_state(model) if self.lora else model.state_dict()
        self.engine.update_weights(state, version)
        return sum(t.numel() * t.element_size() for t in state.values())


def build(cfg: RunConfig, run_dir: Path) -> DiffusionRun:
    device = torch.device(
        "cuda" if cfg.trainer.device != "cpu" and torch.cuda.is_available() else "cpu"
    )
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    assert cfg.model.path is not None  # RunConfig requires it for model.kind=diffusion
    model, meta = tiny.load(cfg.model.path, device)
    lora = cfg.model.lora if cfg.model.lora.enabled else None
    if lora is not None:
        adapters.adapt(model, lora, cfg.seed)
    reward = load_reward(cfg.diffusion.reward, cfg.diffusion.clip_path)
    trainer = DiffusionTrainer(model, cfg.diffusion, cfg.trainer, device, cfg.seed)
    size = meta["image_size"]
    if cfg.diffusion.engine == "http":
        engine_device = torch.device(cfg.diffusion.engine_device or device)
        server, client = remote.launch(cfg.model.path, run_dir, engine_device)
        run = DiffusionRun(
            cfg, client, trainer, reward, Path(cfg.model.path), run_dir, size, server, lora=lora
        )
        if cfg.sync.transport == "broadcast":
            try:
                run.broadcast = remote.BroadcastPush(
                    client,
                    bucket_bytes=cfg.sync.bucket_mb << 20,
                    max_resends=cfg.sync.max_resends,
                    backend=remote.group_backend(device, engine_device),
                    lora=lora,
                )
            except BaseException:
                server.stop()
                raise
        return run
    # fully asynchronous, the engine samples while the trainer updates: weights of its own
    own = copy.deepcopy(model) if cfg.mode == "fully_async" else model
    engine = DiffusionEngine(own, size, device)
    return DiffusionRun(
        cfg, engine, trainer, reward, Path(cfg.model.path), run_dir, size, lora=lora
    )


def score(run: DiffusionRun, trajectories: list[Trajectory]) -> torch.Tensor:
    return evaluation.score(run.reward, trajectories)


def evaluate(run: DiffusionRun, step: int) -> dict[str, float]:
    """Mean reward of every caption under held-out seeds (ODE sampling); saves the grid."""
    grid = run.run_dir / f"samples_step{step}.png"
    return evaluation.evaluate(run.engine, run.reward, run.cfg.diffusion, grid)


def collect(run: DiffusionRun, step: int) -> tuple[list[Trajectory], list[list[int]], dict]:
    """This step's trajectories and each one's trained steps: generated now (sync), or one
    batch of finished groups from the fully asynchronous worker, already scored."""
    if run.rollout is None:
        chosen = train_steps(run.cfg, step)
        trajectories = run.engine.generate(requests_for(run.cfg, step, chosen))
        return trajectories, [chosen] * len(trajectories), {}
    samples = [s for group in run.rollout.take(run.engine.weight_version) for s in group]
    trajectories = [s.metadata[TRAJECTORY] for s in samples]
    return trajectories, [s.metadata[TRAIN_STEPS] for s in samples], run.rollout.metrics()


def rl_step(run: DiffusionRun, step: int) -> dict[str, float]:
    cfg, timer = run.cfg, PhaseTimer(step=step)
    phase = "rollout" if run.rollout is None else "wait"
    with timer(phase):
        trajectories, chosen, metrics = collect(run, step)
    with timer("reward"):
        rewards = score(run, trajectories) if run.rollout is None else rewards_of(trajectories)
    with timer("advantages"):
        rewards_P_G = rewards.view(-1, cfg.rollout.n_samples_per_prompt)
        advantages = objectives.group_advantages(rewards_P_G, cfg.diffusion.adv_clip_max).flatten()
    with timer("train"):
        metrics |= run.trainer.step(trajectories, advantages, chosen, step=step)
    with timer("sync"):
        metrics["sync/bytes"] = float(run.sync())
    metrics |= {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()),
        "train/trained_steps": sum(map(len, chosen)) / len(chosen),
    }
    return metrics | timer.metrics(step_phases=(phase, "reward", "advantages", "train", "sync"))


def rewards_of(trajectories: list[Trajectory]) -> torch.Tensor:
    return torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32)


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
    metrics["sync/bytes"] = float(run.sync())
    return metrics | timer.metrics(step_phases=("train",))


def save_checkpoint(run: DiffusionRun, step: int) -> Path:
    """A model directory (usable as model.path) plus the state `--resume` continues from."""
    state = {
        "step": step,
        "weight_version": run.engine.weight_version,
        "optimizer": run.trainer.optimizer.state_dict(),
    }
    if run.rollout is not None:
        state["source"] = run.rollout.source_state()
    keep = run.cfg.checkpoint.keep_last
    return checkpoint.save(
        run.run_dir, step, run.trainer.model, run.model_dir, state, keep_last=keep, lora=run.lora
    )


def train(cfg: RunConfig, run_dir: Path, *, resume: bool = False) -> Path:
    check_writable(run_dir)
    run = build(cfg, run_dir)
    try:
        step, source_state = restore(run) if resume else (0, None)
        if cfg.mode == "fully_async":
            run.rollout = AsyncDiffusionRollout(cfg, run.engine, run.reward, source_state)
        _run(cfg, run, run_dir, step)
    finally:
        if run.rollout is not None:
            run.rollout.close()
        if run.broadcast is not None:
            run.broadcast.close()
        if run.server is not None:
            run.server.stop()
    return run_dir


def restore(run: DiffusionRun) -> tuple[int, dict | None]:
    """The newest checkpoint's weights, optimizer and weight version (pushed to the engine);
    its step and, fully asynchronous, the prompt source's state."""
    state = checkpoint.restore_latest(run.run_dir, run.trainer.model)
    run.trainer.optimizer.load_state_dict(state["optimizer"])
    run.sync(state["weight_version"])
    return int(state["step"]), state.get("source")


def _run(cfg: RunConfig, run: DiffusionRun, run_dir: Path, start: int) -> None:
    data = (
        shapes.dataset(cfg.diffusion.sft_dataset_size, run.image_size, cfg.seed)
        if cfg.diffusion.algorithm == "sft"
        else None
    )
    interval = cfg.diffusion.eval_interval_steps
    with MetricsLogger(
        run_dir,
        cfg.num_steps,
        start_step=start,
        monitor=cfg.monitor,
        config=cfg.model_dump(mode="json"),
    ) as log:
        if start == 0:
            dump_config(cfg, run_dir / "config.yaml")
            log.log({"step": 0, "weight_version": 0} | evaluate(run, 0))
        else:
            log.info(f"resumed from step {start} (weight version {run.engine.weight_version})")
        if run.rollout is not None:
            run.rollout.start()
        for step in range(start + 1, cfg.num_steps + 1):
            metrics = sft_step(run, step, data) if data is not None else rl_step(run, step)
            last = step == cfg.num_steps
            if last or (interval and step % interval == 0):
                metrics |= evaluate(run, step)
            log.log({"step": step, "weight_version": run.engine.weight_version} | metrics)
            if checkpoint_due(cfg.checkpoint, step, last=last):  # after the record, as the LM's
                save_checkpoint(run, step)
        log.info(f"done: {cfg.num_steps} steps; samples and checkpoints in {run_dir}")
