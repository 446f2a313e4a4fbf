"""Supervised warm start before RL: teach the answer format until a dev accuracy is reached.

RL needs some reward signal to start from; a random tiny model has none. The warm start trains
on (prompt, label + EOS) pairs with the loss on the answer only, and stops as soon as greedy dev
accuracy reaches `target_accuracy` (checked every `check_interval_steps`), so RL starts from a
model that is right sometimes, not always.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field

from verst import distributed
from verst.configbase import ConfigBase
from verst.data.source import DataSource, DataSourceConfig
from verst.train.batching import TrainItem
from verst.train.trainer import Trainer
from verst.types import Sample


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


def sft_item(sample: Sample, answer_ids: list[int]) -> TrainItem:
    """prompt + answer, with the loss on the answer tokens only."""
    return TrainItem(
        tokens=sample.prompt_tokens + answer_ids,
        response_length=len(answer_ids),
        loss_mask=[1] * len(answer_ids),
        rollout_logprobs=[0.0] * len(answer_ids),
        advantage=0.0,
    )


def warm_start(
    cfg: WarmStartConfig,
    trainer: Trainer,
    source: DataSource,
    encode_answer: Callable[[str], list[int]],
    dev_accuracy: Callable[[], float],
    log: Callable[[str], None],
) -> dict[str, float]:
    """Run SFT steps until dev accuracy ≥ target or max_steps; returns what happened."""
    optimizer = trainer.make_optimizer(cfg.lr)
    accuracy = 0.0
    loss = float("nan")
    step = 0
    for step in range(1, cfg.max_steps + 1):
        groups = source.take(cfg.batch_size)[distributed.rank() :: distributed.world_size()]
        items = [sft_item(g[0], encode_answer(str(g[0].label))) for g in groups]
        loss = trainer.sft_step(items, optimizer, step=step)
        if step % cfg.check_interval_steps == 0 or step == cfg.max_steps:
            accuracy = dev_accuracy()
            log(f"warm start step {step}: sft loss {loss:.4f}, dev accuracy {accuracy:.3f}")
            if accuracy >= cfg.target_accuracy:
                break
    return {
        "warm_start/steps": float(step),
        "warm_start/dev_accuracy": accuracy,
        "warm_start/loss": loss,
    }
