"""Held-out evaluation on an engine: each evaluation set's prompts, sampled and scored.

Each set's prompts are read once, in file order, and never shuffled, so every measurement of a
run (and of runs with other seeds) scores the same prompts. In the loop (`eval.mode: shared`)
each rank scores its slice and the sums are added over ranks; a snapshot evaluation
(`verst.eval.points`) runs on rank 0 alone and scores every prompt (`sharded=False`).

With `rollout.function` set, the function generates and scores each set's groups
(`verst.eval.rollout_fn`). An evaluation that raises (the engine, the function) raises
`EvalSkip("crashed")` on every rank together, after the ranks' sums are added, so a point is
skipped, never the run stopped.

Metrics (`verst.eval.scores`): `eval/accuracy` (mean@k), `eval/pass@k`, `eval/num_prompts`,
`eval/response_len_mean`, `eval/weight_version/mean`, `eval/mixed_version_ratio` for the default
set; `eval/<set>/...` for each named set, and then `eval/accuracy` is the mean over all sets'
samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from verst import distributed
from verst.engine import SamplingParams
from verst.eval.scores import group_sums, set_metrics
from verst.plugins import EvalSkip, Generator
from verst.rollout.generate import generate_groups
from verst.rollout.rewards import RewardScorer
from verst.types import Group, Sample

log = logging.getLogger(__name__)

EvalGenerate = Callable[
    [Generator, list[Group], SamplingParams, RewardScorer, Callable[[list[int]], str], int],
    list[Group],
]
"""Generates and scores a set's groups: (engine, groups, params, rewards, decode, step)."""


class Evaluator:
    def __init__(
        self,
        params: SamplingParams,
        n_samples: int,
        prompts: list[Sample],
        rewards: RewardScorer,
        decode: Callable[[list[int]], str],
        device: torch.device,
        prefix: str = "eval",
        *,
        sharded: bool = True,
        generate: EvalGenerate | None = None,
    ) -> None:
        """`prefix`: of the metric names (`eval/<set>`, `eval/<adapter>` for multi-LoRA);
        `sharded`: each rank scores its slice and every rank calls `run` together;
        `generate`: in place of the engine call and the reward (`rollout.function`'s)."""
        self.prefix = prefix
        self.params = params
        self.n_samples = n_samples
        self.sharded = sharded
        self.prompts = (
            prompts[distributed.rank() :: distributed.world_size()] if sharded else prompts
        )
        self.rewards = rewards
        self.decode = decode
        self.device = device
        self.generate = generate

    def run(self, engine: Generator, *, step: int = 0) -> dict[str, float]:
        """The set's metrics on `engine`, for the point of `step`."""
        groups = [
            [prompt.clone_prompt(i) for i in range(self.n_samples)] for prompt in self.prompts
        ]
        failure = ""
        try:
            if self.generate is not None:
                groups = self.generate(engine, groups, self.params, self.rewards, self.decode, step)
            else:
                generate_groups(engine, self.decode, groups, self.params)
                self.rewards.score_groups(groups)
        except Exception as error:  # the point's failure, not the run's
            log.exception("evaluation %s failed", self.prefix)
            failure, groups = f"{type(error).__name__}: {error}", []
        sums = group_sums(groups, self.n_samples) | {"failed": float(bool(failure))}
        if self.sharded:
            sums = dict(
                zip(sums, distributed.all_reduce_sum(list(sums.values()), self.device), strict=True)
            )
        if sums.pop("failed"):
            raise EvalSkip("crashed", failure or "the evaluation failed on another rank")
        return set_metrics(sums, self.prefix)


class SetEvaluators:
    """Several named evaluators (`eval/<name>/...`, multi-LoRA's adapters among them), and
    `eval/accuracy`, `eval/weight_version/mean`, `eval/mixed_version_ratio` over all of them."""

    def __init__(self, evaluators: dict[str, Evaluator]) -> None:
        self.evaluators = evaluators

    def run(self, engine: Generator, *, step: int = 0) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for evaluator in self.evaluators.values():
            metrics |= evaluator.run(engine, step=step)
        weights = {
            name: metrics[f"eval/{name}/num_prompts"] * e.n_samples
            for name, e in self.evaluators.items()
        }
        total = sum(weights.values()) or 1.0
        for key in ("accuracy", "weight_version/mean", "mixed_version_ratio"):
            metrics[f"eval/{key}"] = (
                sum(metrics[f"eval/{name}/{key}"] * w for name, w in weights.items()) / total
            )
        metrics["eval/num_prompts"] = sum(metrics[f"eval/{n}/num_prompts"] for n in weights)
        return metrics


def invalid_reason(metrics: dict[str, float], version: int) -> str | None:
    """Why a point does not measure weight version `version` alone, or None when it does."""
    mixed = metrics.get("eval/mixed_version_ratio", 0.0)
    mean = metrics.get("eval/weight_version/mean", float(version))
    if mixed > 0:
        return f"{mixed:.0%} of its samples were generated by more than one weight version"
    if not abs(mean - version) <= 1e-9:  # NaN (a sample with no version) is no match either
        return f"its samples' mean weight version is {mean}, not {version}"
    return None
