"""The SFT loop (`mode: sft`, `verst sft CONFIG`): batch → supervised step → eval → checkpoint.

`run_sft(cfg, run_dir, resume=...)` trains the policy on the `sft:` section's rows with the
`trainer:` section's optimiser and schedule, on the same trainer as RL (either
`trainer.backend`). Every record of `metrics.jsonl` is one step: `sft/loss` (mean NLL of the
trained tokens), `sft/tokens`, `train/grad_norm`, `train/lr`, and at evaluations `eval/loss`,
`eval/token_accuracy` and `eval/accuracy` (the share of held-out examples greedy decoding
would write exactly). Its checkpoints are HF model directories that `verst train` starts RL
from (`model.path`), and `--resume` continues from the newest one with the same batches an
uninterrupted run would see.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verst import distributed
from verst.config import RunConfig, dump_config
from verst.launch import load_policy, make_trainer
from verst.models.loading import eos_token_ids
from verst.monitor.metrics import MetricsLogger
from verst.monitor.timer import PhaseTimer
from verst.rundir import check_writable
from verst.train.algorithms import LossConfig
from verst.train.batching import TrainItem
from verst.train.checkpoint import Checkpointer, remove_partial_checkpoints
from verst.train.policy import PolicyModels
from verst.train.sft import SFTConfig, rank_share
from verst.train.sft_data import SFTBatches, load_examples
from verst.train.trainer import NonFiniteLossError, Trainer


@dataclass
class SFTRun:
    cfg: SFTConfig
    trainer: Trainer
    checkpointer: Checkpointer
    items: list[TrainItem]
    eval_items: list[TrainItem]  # this rank's share
    batches: SFTBatches
    total_steps: int
    skipped: int  # training rows longer than max_seq_len


def build_sft(cfg: RunConfig, run_dir: Path) -> SFTRun:
    device, model, shell, tokenizer = load_policy(cfg)
    eos_id = eos_token_ids(shell, tokenizer)[0]
    sft = cfg.sft
    items, skipped = load_examples(sft.data, sft, tokenizer, eos_id)
    eval_items = load_examples(sft.eval_data, sft, tokenizer, eos_id)[0] if sft.eval_data else []
    batches = SFTBatches(
        [len(item.tokens) for item in items],
        batch_size=sft.batch_size,
        batch_tokens=sft.batch_tokens,
        shuffle=sft.data.shuffle,
        seed=cfg.seed,
    )
    total_steps = batches.steps_for(sft.epochs)
    if sft.max_steps is not None:
        total_steps = min(total_steps, sft.max_steps)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    trainer = make_trainer(cfg, model, pad, device, sft_steps=total_steps)
    checkpointer = Checkpointer(
        cfg.checkpoint,
        run_dir,
        policy=PolicyModels(trainer, shell, LossConfig(), run_dir, cfg.model.lora),
        tokenizer=tokenizer,
        data_state=batches.state_dict,
        load_data_state=batches.load_state_dict,
        engine_generator=None,
    )
    eval_share = eval_items[distributed.rank() :: distributed.world_size()]
    return SFTRun(sft, trainer, checkpointer, items, eval_share, batches, total_steps, skipped)


def run_sft(cfg: RunConfig, run_dir: Path, *, resume: bool = False) -> Path:
    check_writable(run_dir)
    run = build_sft(cfg, run_dir)
    step = run.checkpointer.restore_latest()[0] if resume else 0
    config = cfg.model_dump(mode="json")
    with MetricsLogger(
        run_dir, run.total_steps, start_step=step, label="SFT", monitor=cfg.monitor, config=config
    ) as log:
        if step == 0:
            dump_config(cfg, run_dir / "config.yaml")
            log.info(
                f"sft: {len(run.items)} training examples ({run.skipped} skipped, longer than "
                f"sft.max_seq_len), {len(run.eval_items)} held out; {run.total_steps} steps"
            )
            log.log({"step": 0} | evaluate(run))
        else:
            for stale in remove_partial_checkpoints(run_dir):
                log.info(f"removed {stale}: a checkpoint whose save never finished")
            log.info(f"resumed from step {step} in {run_dir}")
        while step < run.total_steps:
            step += 1
            if sft_step(run, log, step):
                break
    log.info(f"done: {step} steps; checkpoints in {run_dir / 'checkpoints'}")
    return run_dir


def sft_step(run: SFTRun, log: MetricsLogger, step: int) -> bool:
    """One supervised step with its evaluation and checkpoint; True when the run is done."""
    timer = PhaseTimer(step=step)
    with timer("train"):
        epoch = run.batches.epochs_done
        metrics = train_step(run, rank_share(run.items, run.batches.next()), step)
    interval = run.cfg.eval_interval_steps
    last = step == run.total_steps
    if run.cfg.eval_data is not None and (last or (interval and step % interval == 0)):
        with timer("eval"):
            metrics |= evaluate(run)
        target = run.cfg.target_accuracy
        last = last or (target is not None and metrics["eval/accuracy"] >= target)
    checkpoint = run.checkpointer.due(step, last=last)
    if checkpoint:
        with timer("checkpoint"):
            run.checkpointer.write(step, step)
    perf = timer.metrics(step_phases=("train",), tokens=metrics.get("sft/tokens"))
    log.log({"step": step, "sft/epoch": epoch} | metrics | perf)
    if checkpoint:  # after the record: a crash before the commit resumes before this step
        run.checkpointer.commit(step)
    return last


def train_step(run: SFTRun, items: list[TrainItem], step: int) -> dict[str, float]:
    """One optimiser step; a non-finite loss stops the run at a good checkpoint."""
    trainer = run.trainer
    lr = trainer.scheduler.get_last_lr()[0]
    try:
        result = trainer.sft_step(items, trainer.optimizer, step=step, scheduler=trainer.scheduler)
    except NonFiniteLossError as error:
        saved = run.checkpointer.save(step - 1, step - 1, keep_existing=True)
        raise NonFiniteLossError(f"{error}; last good checkpoint: {saved}") from None
    return {
        "sft/loss": result["loss"],
        "sft/tokens": result["tokens"],
        "train/grad_norm": result["grad_norm"],
        "train/lr": lr,
    } | {key: value for key, value in result.items() if key.startswith("perf/")}


def evaluate(run: SFTRun) -> dict[str, float]:
    """Held-out loss and accuracy; nothing when the run has no held-out data."""
    if run.cfg.eval_data is None:
        return {}
    return run.trainer.sft_eval(run.eval_items)
