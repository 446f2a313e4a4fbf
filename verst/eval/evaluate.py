"""Held-out evaluation on the rollout engine: accuracy = mean reward over a fixed prompt set.

The prompt set is read once, in file order, and never shuffled, so every measurement of a run
(and of runs with other seeds) scores the same prompts. Each rank scores its slice; the result
is summed over ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field, field_validator

from verst import distributed
from verst.configbase import ConfigBase
from verst.data.source import DataSourceConfig
from verst.engine import SamplingParams
from verst.plugins import Generator
from verst.rollout.generate import generate_groups
from verst.rollout.rewards import RewardScorer, load_reward_fn
from verst.types import Sample


class EvalConfig(ConfigBase):
    interval_steps: int = Field(
        0,
        ge=0,
        description="evaluate every N RL steps, before the first and after the last; 0 = never",
    )
    data: DataSourceConfig = Field(
        default_factory=lambda: DataSourceConfig(task="addition", split="test", shuffle=False),
        description="held-out prompts",
    )
    max_new_tokens: int = Field(256, ge=1, description="response length limit for evaluation")
    temperature: float = Field(0.0, ge=0, description="evaluation temperature; 0 = greedy")
    reward: str | None = Field(
        None, description="reward function for scoring; unset = the rollout's reward"
    )

    @field_validator("reward")
    @classmethod
    def _reward_importable(cls, value: str | None) -> str | None:
        if value is not None:
            load_reward_fn(value, field="eval.reward")
        return value


class Evaluator:
    def __init__(
        self,
        cfg: EvalConfig,
        prompts: list[Sample],
        rewards: RewardScorer,
        decode: Callable[[list[int]], str],
        device: torch.device,
        prefix: str = "eval",
    ) -> None:
        """`prefix`: of the metric names (`eval/<adapter>` for an adapter of multi-LoRA)."""
        self.prefix = prefix
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
        self.prompts = prompts[distributed.rank() :: distributed.world_size()]
        self.rewards = rewards
        self.decode = decode
        self.device = device

    def run(self, engine: Generator) -> dict[str, float]:
        groups = [[prompt.clone_prompt(0)] for prompt in self.prompts]
        generate_groups(engine, self.decode, groups, self.params)
        self.rewards.score_groups(groups)
        rewards = [group[0].reward or 0.0 for group in groups]
        lengths = [group[0].response_length for group in groups]
        total, count, length_sum = distributed.all_reduce_sum(
            [sum(rewards), float(len(rewards)), float(sum(lengths))], self.device
        )
        return {
            f"{self.prefix}/accuracy": total / max(count, 1.0),
            f"{self.prefix}/response_len_mean": length_sum / max(count, 1.0),
            f"{self.prefix}/num_prompts": count,
        }


class AdapterEvaluators:
    """Multi-LoRA: each adapter evaluated on its own held-out prompts with its own reward
    (`eval/<name>/...`), and `eval/accuracy`, the mean over all their prompts."""

    def __init__(self, evaluators: dict[str, Evaluator]) -> None:
        self.evaluators = evaluators

    def run(self, engine: Generator) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for evaluator in self.evaluators.values():
            metrics |= evaluator.run(engine)
        counts = {name: metrics[f"eval/{name}/num_prompts"] for name in self.evaluators}
        total = sum(counts.values())
        metrics["eval/accuracy"] = (
            sum(metrics[f"eval/{name}/accuracy"] * n for name, n in counts.items()) / total
        )
        metrics["eval/num_prompts"] = total
        return metrics
