"""The synchronous RL loop: rollout → reward → train → sync, one step at a time.

`train(cfg, run_dir, resume=...)` is what `verst train` runs. The components are built in
`verst/launch.py`; this file holds only the order of events, so it reads like the algorithm.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from verst import distributed, launch
from verst.config import RunConfig, dump_config
from verst.monitor.metrics import MetricsLogger
from verst.train.batching import TrainItem
from verst.train.losses import LossConfig, group_advantages
from verst.train.sft import warm_start
from verst.train.trainer import NonFiniteLossError
from verst.types import Group, Status


def train_items(groups: list[Group], loss: LossConfig) -> list[TrainItem]:
    """Samples as the trainer takes them, with their sequence-level advantage: relative to the
    group for the group estimators, the reward itself for the token-level ones (PPO,
    REINFORCE++), which the trainer turns into per-token advantages."""
    samples = [s for group in groups for s in group]
    rewards = torch.tensor([s.reward or 0.0 for s in samples], dtype=torch.float64)
    group_ids = torch.tensor([s.group_index for s in samples])
    estimator = loss.advantage_estimator
    if estimator in ("grpo", "gspo"):
        advantages = group_advantages(
            rewards, group_ids, std_normalization=loss.grpo_std_normalization
        )
    elif estimator in ("dr_grpo", "reinforce_plus_plus_baseline"):
        advantages = group_advantages(rewards, group_ids, std_normalization=False)
    else:
        advantages = rewards
    return [TrainItem.from_sample(s, float(a)) for s, a in zip(samples, advantages, strict=True)]


def without_aborted(groups: list[Group]) -> list[Group]:
    """The groups without their ABORTED samples: an abandoned trajectory (an agent that raised
    or timed out, an engine abort) teaches nothing, and kept with reward 0 it would pull its
    group's baseline towards a score no completed attempt earned. Emptied groups go."""
    kept = [[s for s in group if s.status != Status.ABORTED] for group in groups]
    return [group for group in kept if group]


def train(cfg: RunConfig, run_dir: Path, *, resume: bool = False) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    run = launch.build(cfg, run_dir)
    try:
        step, version = run.restore_latest() if resume else (0, 0)
        with MetricsLogger(run_dir, cfg.num_steps, start_step=step) as log:
            version = begin(cfg, run, log, step, version)
            if cfg.mode == "fully_async":
                fully_async_steps(cfg, run, log, step, version)
            else:
                sync_steps(cfg, run, log, step, version)
        log.info(f"done: {cfg.num_steps} steps; checkpoints in {run_dir / 'checkpoints'}")
    finally:
        run.close()
    return run_dir


def begin(cfg: RunConfig, run: launch.Run, log: MetricsLogger, step: int, version: int) -> int:
    """Step 0 (config, warm start, reference, first push, first eval) or a resume's push;
    returns the weight version the engines now hold."""
    if step > 0:
        run.sync.push(version)
        log.info(f"resumed from step {step} (weight version {version}) in {run.run_dir}")
        return version
    dump_config(cfg, run.run_dir / "config.yaml")
    first = {"step": 0}
    if cfg.warm_start.enabled:
        first |= warm_start(
            cfg.warm_start,
            run.trainer,
            run.warm_start_data,
            run.encode_answer,
            run.dev_accuracy,
            log.info,
        )
    run.start_rl()
    version = run.engine.weight_version + 1  # after the warm start's versions, if any
    run.sync.push(version)
    first["weight_version"] = version
    if run.evaluator is not None:
        first |= run.evaluator.run(run.engine)
    log.log(first)
    return version


def train_step(run: launch.Run, groups: list[Group], step: int, version: int) -> dict[str, float]:
    """One optimiser step on `groups`; a non-finite loss stops the run at a good checkpoint."""
    try:
        return run.trainer.step(train_items(groups, run.cfg.loss), step=step)
    except NonFiniteLossError as error:
        saved = run.save(step - 1, version, keep_existing=True)
        raise NonFiniteLossError(f"{error}; last good checkpoint: {saved}") from None


def finish_step(
    cfg: RunConfig, run: launch.Run, log: MetricsLogger, step: int, version: int, metrics: dict
) -> None:
    """Evaluate and checkpoint when due, then log the step."""
    last = step == cfg.num_steps
    if run.evaluator is not None and (last or step % cfg.eval.interval_steps == 0):
        metrics |= run.evaluator.run(run.engine)
    if last or (cfg.checkpoint.interval_steps and step % cfg.checkpoint.interval_steps == 0):
        run.save(step, version)
    log.log(metrics)


def sync_steps(
    cfg: RunConfig, run: launch.Run, log: MetricsLogger, step: int, version: int
) -> None:
    """Rollout, train, sync, in turn."""
    while step < cfg.num_steps:
        step += 1
        started = time.perf_counter()
        groups, sampling_metrics = run.rollout()
        rolled = time.perf_counter()
        trainable = without_aborted(groups)
        metrics: dict[str, float] = {}
        sync_metrics: dict[str, float] = {}
        if distributed.all_reduce_sum([float(len(trainable))], run.device)[0] > 0:
            metrics = train_step(run, trainable, step, version)
            trained = time.perf_counter()
            version += 1
            sync_metrics = run.sync.push(version)
        else:
            log.info(f"step {step}: every trajectory was aborted; no update this step")
            trained = time.perf_counter()
        synced = time.perf_counter()

        metrics = {"step": step, "weight_version": version} | metrics
        metrics |= run.group_metrics(groups) | sampling_metrics | sync_metrics
        metrics |= {
            "perf/rollout_time_s": rolled - started,
            "perf/train_time_s": trained - rolled,
            "perf/sync_time_s": synced - trained,
            "perf/step_time_s": synced - started,
        }
        finish_step(cfg, run, log, step, version, metrics)


def fully_async_steps(
    cfg: RunConfig, run: launch.Run, log: MetricsLogger, step: int, version: int
) -> None:
    """The engines generate without pause (except to install weights) while the trainer takes
    finished groups from the data buffer, trains on them and pushes new weights."""
    worker = run.start_rollout_worker()
    try:
        while step < cfg.num_steps:
            step += 1
            started = time.perf_counter()
            groups = run.take_groups(worker, version)
            waited = time.perf_counter()
            metrics = train_step(run, groups, step, version)
            trained = time.perf_counter()
            version += 1
            sync_metrics = run.sync.push(version)
            synced = time.perf_counter()

            metrics = {"step": step, "weight_version": version} | metrics
            metrics |= run.group_metrics(groups) | sync_metrics
            metrics |= run.worker_metrics(worker)
            metrics |= {
                "perf/wait_time_s": waited - started,
                "perf/train_time_s": trained - waited,
                "perf/sync_time_s": synced - trained,
                "perf/step_time_s": synced - started,
            }
            finish_step(cfg, run, log, step, version, metrics)
    finally:
        run.stop_rollout_worker(worker)
