"""Evaluation through the run's rollout function (`rollout.function`), when one is set.

The function is called with the evaluation set's groups in `RolloutRequest.prompts` and a
context of the set's own: `generate` samples with the set's parameters (temperature,
max_new_tokens) on the engine the point runs on (the rollout's in `shared` mode, the eval
fleet in `fleet` mode, the checkpoint's engine in `verst eval`), `score` uses the set's reward,
`take` refuses (an evaluation draws nothing) and there is no filter. It must return those
groups, every sample generated; samples it left unscored get the set's reward, as in training.
"""

from __future__ import annotations

from verst.engine import SamplingParams
from verst.plugin_loader import load_plugin
from verst.plugins import Decode, Generator, RolloutContext, RolloutFunction, RolloutRequest
from verst.rollout.generate import generate_groups
from verst.rollout.rewards import RewardScorer
from verst.rollout.source import call_rollout_function
from verst.types import Group

FIELD = "rollout.function"


def _no_draw(n: int) -> list[Group]:
    raise RuntimeError(
        "an evaluation's rollout function generates request.prompts; context.take draws nothing"
    )


class RolloutFunctionEval:
    """Generates and scores an evaluation set's groups with `rollout.function`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fn: RolloutFunction = load_plugin(path, RolloutFunction, field=FIELD)

    def __call__(
        self,
        engine: Generator,
        groups: list[Group],
        params: SamplingParams,
        rewards: RewardScorer,
        decode: Decode,
        step: int,
    ) -> list[Group]:
        context = RolloutContext(
            prompts_per_step=len(groups),
            n_samples_per_prompt=max(map(len, groups), default=0),
            take=_no_draw,
            generate=lambda gs: generate_groups(engine, decode, gs, params),
            score=rewards.score_groups,
            keep=None,
            engine=engine,
            decode=decode,
            params=params,
        )
        request = RolloutRequest(step, int(engine.weight_version), prompts=groups)
        result = call_rollout_function(self.fn, self.path, context, request)
        sizes, asked = [len(g) for g in result.groups], [len(g) for g in groups]
        if sizes != asked:
            raise ValueError(
                f"{FIELD} {self.path!r} returned groups of sizes {sizes} for an evaluation of "
                f"{asked}: it must return request.prompts, generated, dropping none"
            )
        rewards.score_groups(result.groups)
        return result.groups
