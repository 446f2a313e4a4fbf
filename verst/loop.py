"""The RL loop: rollout → reward → advantages → train → sync → eval → checkpoint, a step at a time.

`train(cfg, run_dir, resume=...)` is what `verst train` runs. The components are built in
`verst/launch.py`; this file holds only the order of events, so it reads like the algorithm.
Each phase is one line under the step's `PhaseTimer`, which logs `perf/<phase>_time_s`.

After the reward phase the rollout settles the step: groups with too few scored samples go back
to the data source, and every group's fate goes into the prompt ledger (`prompts.jsonl`, see
`verst.rollout.ledger`), stamped with the step `run.ledger.step` names. With `loss.opd`, the
teachers then score the trainable samples' tokens (`verst.rollout.teacher`), and the trainer
moves each token's advantage by the teacher's verdict.

The synchronous loop draws each step's groups after the previous update; the fully
asynchronous one (`mode: fully_async`) takes finished groups from engines that never stop
generating, so its rollout phase is a wait (`perf/wait_time_s`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from verst import distributed, launch
from verst.config import RunConfig, dump_config
from verst.monitor.metrics import MetricsLogger
from verst.monitor.timer import PhaseTimer
from verst.rundir import check_writable
from verst.sync.embedded import EmbeddedSync
from verst.train.algorithms import LossConfig, sample_advantages
from verst.train.batching import TrainItem
from verst.train.checkpoint import remove_partial_checkpoints
from verst.train.sft import warm_start
from verst.train.trainer import NonFiniteLossError
from verst.types import Group


def train_items(groups: list[Group], loss: LossConfig) -> list[TrainItem]:
    """Samples as the trainer takes them, with their estimator's sequence-level advantage
    (token-level estimators such as PPO build per-token ones inside the trainer)."""
    samples = [s for group in groups for s in group]
    advantages = sample_advantages(samples, loss)
    return [TrainItem.from_sample(s, float(a)) for s, a in zip(samples, advantages, strict=True)]


def only_scored(groups: list[Group]) -> list[Group]:
    """The groups without their ABORTED and FAILED samples: an abandoned trajectory (an agent
    that raised or timed out, an engine abort) teaches nothing, nor does one whose reward
    failed (it raised, returned a non-number or timed out), and kept with reward 0 it would pull
    its group's baseline towards a score no completed attempt earned. Emptied groups go."""
    kept = [[s for s in group if s.scored] for group in groups]
    return [group for group in kept if group]


def train(cfg: RunConfig, run_dir: Path, *, resume: bool = False) -> Path:
    check_writable(run_dir)
    run = launch.build(cfg, run_dir)
    try:
        step, version = run.checkpointer.restore_latest() if resume else (0, 0)
        config = cfg.model_dump(mode="json")
        with MetricsLogger(
            run_dir, cfg.num_steps, start_step=step, monitor=cfg.monitor, config=config
        ) as log:
            version = begin(cfg, run, log, step, version)
            run.ledger.step = step + 1  # fates decided from now on belong to the next step
            run.rollout.start()
            while step < cfg.num_steps:
                step += 1
                version = rl_step(cfg, run, log, step, version)
                run.ledger.step = step + 1
            run.ledger.record_pending(run.rollout.data_state()["returned"])
            for record in run.evals.finished(wait=True):  # pending evaluations drain at exit
                log.log(record)
        log.info(f"done: {cfg.num_steps} steps; checkpoints in {run_dir / 'checkpoints'}")
    finally:
        run.close()
    return run_dir


def begin(cfg: RunConfig, run: launch.Run, log: MetricsLogger, step: int, version: int) -> int:
    """Step 0 (config, warm start, reference, first push, first eval) or a resume's push;
    returns the weight version the engines now hold."""
    if step > 0:
        for stale in remove_partial_checkpoints(run.run_dir):
            log.info(f"removed {stale}: a checkpoint whose save never finished")
        run.sync.push(version)
        log.info(f"resumed from step {step} (weight version {version}) in {run.run_dir}")
        return version
    dump_config(cfg, run.run_dir / "config.yaml")
    first = {"step": 0}
    if run.warm_start_items is not None:
        first |= warm_start(
            cfg.warm_start,
            run.policy.trainer,
            run.warm_start_items,
            run.dev_accuracy,
            log.info,
            seed=cfg.seed,
        )
    run.policy.start_rl()
    version = int(run.engine.weight_version) + 1  # after the warm start's versions, if any
    run.sync.push(version)
    first["weight_version"] = version
    if run.evals.due(0):
        first |= run.evals.at_step(0, version)
    log.log(first)
    return version


def rl_step(cfg: RunConfig, run: launch.Run, log: MetricsLogger, step: int, version: int) -> int:
    """One step; returns the weight version the engines hold after it."""
    timer = PhaseTimer(step=step, memory_device=run.device)
    rollout_phase = "wait" if cfg.mode == "fully_async" else "rollout"
    with timer(rollout_phase):
        groups, metrics = run.rollout.groups(version)
    with timer("reward"):
        run.rewards.score_groups(groups)
    if run.samples is not None:
        run.samples.record(step, groups)
    trainable = only_scored(run.rollout.settle(groups))
    if distributed.all_reduce_sum([float(len(trainable))], run.device)[0] > 0:
        if run.teacher is not None:
            with timer("teacher"):
                metrics |= run.teacher.score_groups(trainable, run.device)
        with timer("advantages"):
            items = train_items(trainable, cfg.loss)
        with timer("train"), engine_asleep(cfg, run) as released:
            metrics |= train_step(run, items, step, version) | released
        version += 1
        with timer("sync"):
            metrics |= run.sync.push(version)
    else:
        log.info(f"step {step}: no group had enough scored samples; no update this step")
    metrics |= run.rollout.metrics(groups)
    if run.fleet is not None:
        metrics |= run.fleet.fault_metrics()
    metrics |= run.engine_stats.sample()
    last = step == cfg.num_steps
    if run.evals.due(step, last=last):
        with timer("eval"):
            metrics |= run.evals.at_step(step, version, last=last)
    checkpoint = run.checkpointer.due(step, last=last)
    if checkpoint:
        with timer("checkpoint"):
            run.checkpointer.write(step, version)
    step_phases = (rollout_phase, "reward", "teacher", "advantages", "train", "sync")
    perf = timer.metrics(step_phases=step_phases, tokens=metrics.get("rollout/response_tokens"))
    log.log({"step": step, "weight_version": version} | metrics | perf)
    if checkpoint:  # after the record: a crash before the commit resumes before this step
        run.checkpointer.commit(step)
    for record in run.evals.finished():  # snapshot evaluations, at the steps they measured
        log.log(record)
    return version


def engine_asleep(cfg: RunConfig, run: launch.Run) -> AbstractContextManager[dict[str, float]]:
    """`placement.sleep_engines`: the embedded engine's memory is the trainer's inside."""
    if cfg.placement.sleep_engines and isinstance(run.sync, EmbeddedSync):
        return run.sync.sleeping()
    return nullcontext({})


def train_step(run: launch.Run, items: list[TrainItem], step: int, version: int) -> dict:
    """One optimiser step; a non-finite loss stops the run at a good checkpoint."""
    try:
        return run.policy.trainer.step(items, step=step)
    except NonFiniteLossError as error:
        saved = run.checkpointer.save(step - 1, version, keep_existing=True)
        raise NonFiniteLossError(f"{error}; last good checkpoint: {saved}") from None
