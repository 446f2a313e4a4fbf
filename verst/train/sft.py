"""Supervised fine-tuning: the `sft:` section of `mode: sft`, and the warm start before RL.

Both train on `TrainItem`s from `verst.train.sft_data` (the loss on what the model is taught to
write) with `Trainer.sft_step`, batches served by `SFTBatches`. The SFT mode's loop is
`verst.sft_loop`. The warm start is a short use of the same path: prompt/label pairs, stopped as
soon as greedy dev accuracy on the rollout engine reaches `target_accuracy` (checked every
`check_interval_steps`), so RL starts from a model that is right sometimes, not always. Accuracy
can jump past the target between two checks; with `keep_nearest` the warm start then goes back to
the previous check's weights when their accuracy is nearer the target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import Field, model_validator

from verst import distributed
from verst.configbase import ConfigBase
from verst.data.source import DataSourceConfig
from verst.train.batching import TrainItem
from verst.train.sft_data import SFTBatches, SFTFormatConfig
from verst.train.trainer import Trainer


class SFTConfig(SFTFormatConfig):
    """`mode: sft`: the data, batches and evaluation; the optimiser is the `trainer:` section."""

    data: DataSourceConfig = Field(
        default_factory=lambda: DataSourceConfig(task="addition", split="train"),
        description="training rows: chat messages or prompt/completion pairs",
    )
    eval_data: DataSourceConfig | None = Field(
        default_factory=lambda: DataSourceConfig(task="addition", split="dev", shuffle=False),
        description="held-out rows for eval/loss and eval/accuracy; null = no evaluation",
    )
    batch_size: int = Field(64, ge=1, description="examples per step (unless batch_tokens)")
    batch_tokens: int | None = Field(
        None, ge=1, description="tokens per step instead of batch_size (at least one example)"
    )
    epochs: float = Field(1.0, gt=0, description="passes over the training data")
    max_steps: int | None = Field(
        None, ge=1, description="stop after this many steps even if epochs are not done"
    )
    eval_interval_steps: int = Field(
        50, ge=0, description="evaluate every N steps, at step 0 and at the end; 0 = end only"
    )
    target_accuracy: float | None = Field(
        None, gt=0, le=1, description="stop once eval/accuracy reaches this; unset = never"
    )

    @model_validator(mode="after")
    def _target_needs_eval(self) -> SFTConfig:
        if self.target_accuracy is not None and self.eval_data is None:
            raise ValueError("sft.target_accuracy needs sft.eval_data to measure accuracy on")
        return self


class WarmStartConfig(ConfigBase):
    enabled: bool = Field(False, description="run supervised fine-tuning before RL")
    data: DataSourceConfig = Field(
        default_factory=lambda: DataSourceConfig(task="addition", split="train"),
        description="prompt/label pairs to imitate",
    )
    dev_data: DataSourceConfig = Field(
        default_factory=lambda: DataSourceConfig(task="addition", split="dev", shuffle=False),
        description="held-out prompts whose greedy accuracy ends the warm start",
    )
    batch_size: int = Field(128, ge=1, description="examples per SFT step")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the warm start")
    max_steps: int = Field(500, ge=1, description="upper bound on SFT steps")
    target_accuracy: float = Field(
        0.3, gt=0, le=1, description="stop once greedy dev accuracy reaches this"
    )
    check_interval_steps: int = Field(5, ge=1, description="measure dev accuracy every N steps")
    keep_nearest: bool = Field(
        True,
        description="when the check that reaches the target overshoots it, go back to the "
        "previous check's weights if their accuracy is nearer the target (a copy of the "
        "weights is kept at every check)",
    )

    @property
    def format(self) -> SFTFormatConfig:
        """Rows as prompt/completion pairs whose completion is the label."""
        return SFTFormatConfig(format="prompt_completion", completion_key=self.data.label_key)


def rank_share(items: list[TrainItem], batch: list[int]) -> list[TrainItem]:
    """This rank's items of a batch of indices (every rank draws the same batch)."""
    return [items[i] for i in batch[distributed.rank() :: distributed.world_size()]]


def warm_start(
    cfg: WarmStartConfig,
    trainer: Trainer,
    items: list[TrainItem],
    dev_accuracy: Callable[[], float],
    log: Callable[[str], None],
    *,
    seed: int,
) -> dict[str, float]:
    """Run SFT steps on `items` until dev accuracy ≥ target or max_steps; returns what
    happened."""
    optimizer = trainer.make_optimizer(cfg.lr)
    batches = SFTBatches(
        [len(item.tokens) for item in items],
        batch_size=cfg.batch_size,
        shuffle=cfg.data.shuffle,
        seed=seed,
    )
    accuracy, loss, step = 0.0, float("nan"), 0
    previous: _Check | None = None  # the last check below the target
    for step in range(1, cfg.max_steps + 1):
        loss = trainer.sft_step(rank_share(items, batches.next()), optimizer, step=step)["loss"]
        if step % cfg.check_interval_steps == 0 or step == cfg.max_steps:
            accuracy = dev_accuracy()
            log(f"warm start step {step}: sft loss {loss:.4f}, dev accuracy {accuracy:.3f}")
            if accuracy >= cfg.target_accuracy:
                if previous is not None and previous.nearer(accuracy, cfg.target_accuracy):
                    trainer.load_state(previous.weights, None)
                    step, accuracy, loss = previous.step, previous.accuracy, previous.loss
                    log(f"warm start: back to step {step}, whose accuracy is nearer the target")
                break
            if cfg.keep_nearest:
                previous = _Check(step, accuracy, loss, _policy_weights(trainer))
    return {
        "warm_start/steps": float(step),
        "warm_start/dev_accuracy": accuracy,
        "warm_start/loss": loss,
    }


@dataclass
class _Check:
    step: int
    accuracy: float
    loss: float
    weights: dict[str, torch.Tensor]

    def nearer(self, accuracy: float, target: float) -> bool:
        """Whether this check's accuracy is nearer `target` than `accuracy` is."""
        return abs(self.accuracy - target) < abs(accuracy - target)


def _policy_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """A copy of what `Trainer.load_state` takes back: the adapters with LoRA, else the whole
    model (a collective: every rank calls it)."""
    weights = trainer.adapter_state_dict() if trainer.lora else trainer.full_state_dict()
    # on the CPU a world of one's full state dict may alias the live parameters
    return {name: tensor.clone() for name, tensor in weights.items()}
