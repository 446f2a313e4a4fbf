"""The default generation: every sample of every group goes to the engine in one call.

A group comes back with each Sample's response ids, log-probs, loss mask, status (COMPLETED when
the model stopped, TRUNCATED at the token limit, ABORTED when the engine ended it) and weight
versions; its reward is the next phase's (`verst.rollout.rewards.RewardScorer.score_groups`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field, field_validator, model_validator

from verst.engine import GenerateOutput, GenerateRequest, SamplingParams
from verst.plugins import Generator
from verst.rollout.agent import AgentConfig
from verst.rollout.async_config import AsyncConfig
from verst.rollout.layers import LayersConfig
from verst.rollout.rewards import load_reward_fn
from verst.types import Group, Sample, Status


class RolloutConfig(LayersConfig, AsyncConfig, AgentConfig):
    """Generation, rewards, and (inherited) the plug-in layers, the fully asynchronous worker
    and data buffer, and the agent function of multi-turn rollouts."""

    prompts_per_step: int = Field(16, ge=1, description="prompts (groups) per RL step")
    n_samples_per_prompt: int = Field(8, ge=1, description="samples per prompt (the group size)")
    max_new_tokens: int = Field(256, ge=1, description="response length limit in tokens")
    return_routed_experts: bool = Field(
        False,
        description="MoE: the engines report the experts every token was routed to (SGLang's "
        "return_routed_experts), stored on each Sample; on whenever loss.routing_replay is",
    )
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(-1, description="sample among the k likeliest tokens; -1 = off")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="token ids that end a response, besides EOS"
    )
    pause_mode: Literal["retract", "in_place", "abort"] | None = Field(
        None,
        description="how engines pause for a weight update: retract = requeue in-flight requests "
        "(KV recomputed), in_place = freeze them with their KV, abort = end them; unset = "
        "in_place with mode fully_async, else retract",
    )
    reward: str = Field(
        "exact_match",
        description="reward function: a built-in name (exact_match, numeric_match; none = 0 "
        "for every sample, for pure distillation with loss.opd) or pkg.mod:fn",
    )
    reward_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="most seconds one reward call may take before its sample is FAILED; "
        "null = no bound (a sync reward then runs on the caller's thread)",
    )
    min_scored_samples: int = Field(
        2,
        ge=1,
        description="train a group only if this many of its samples are neither aborted nor "
        "failed (GRPO needs 2 for a baseline); else its prompt is served again later",
    )
    max_prompt_retries: int = Field(
        3,
        ge=0,
        description="most times one prompt is served again after its group could not be "
        "trained; then it is dropped",
    )

    @field_validator("reward")
    @classmethod
    def _reward_importable(cls, value: str) -> str:
        load_reward_fn(value, field="rollout.reward")
        return value

    @model_validator(mode="after")
    def _min_scored_fits_a_group(self) -> RolloutConfig:
        if self.min_scored_samples > self.n_samples_per_prompt:
            raise ValueError(
                f"rollout.min_scored_samples={self.min_scored_samples} exceeds "
                f"rollout.n_samples_per_prompt={self.n_samples_per_prompt}: no group could "
                "ever be trained; set rollout.min_scored_samples to at most the group size "
                "(1 trains groups of one)"
            )
        return self

    @model_validator(mode="after")
    def _one_layer_owns_each_part(self) -> RolloutConfig:
        """An outer layer takes over the inner ones: naming both is a mistake, not a choice."""
        layers = [
            ("rollout.function", self.function),
            ("rollout.generate_function", self.generate_function),
            ("rollout.agent_function", self.agent_function),
        ]
        named = [name for name, value in layers if value is not None]
        if len(named) > 1:
            raise ValueError(
                f"{' and '.join(named)} are both set: {named[0]} takes over what "
                f"{named[1]} does; set one of them"
            )
        if self.function is not None and self.dynamic_sampling:
            raise ValueError(
                "rollout.function owns filtering (context.keep is rollout.filter): set "
                "rollout.filter=reward_variance instead of rollout.dynamic_sampling"
            )
        if self.dynamic_sampling and self.filter not in (None, "reward_variance"):
            raise ValueError(
                f"rollout.dynamic_sampling is the filter reward_variance, and rollout.filter="
                f"{self.filter!r} is another: set one of them"
            )
        default_reward = type(self).model_fields["reward"].default
        if self.group_reward is not None and self.reward != default_reward:
            raise ValueError(
                "rollout.group_reward scores every sample in place of rollout.reward: set one "
                "of them"
            )
        return self

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (off) or a positive number of tokens")
        return value

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=list(self.stop_token_ids),
        )


STATUS_OF_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def output_versions(out: GenerateOutput) -> list[int]:
    """The distinct weight versions that produced the output's tokens, oldest first (a request
    that spans an update carries both); the engine's version when it reports no tokens'."""
    versions = sorted({v for v in out.token_weight_versions if isinstance(v, int)})
    return versions or [int(out.weight_version)]


def fill_sample(
    sample: Sample, out: GenerateOutput, response_text: str, *, routed_experts: bool = False
) -> None:
    """`sample`'s response from `out`; with `routed_experts` (the request asked for them),
    ValueError when the engine returned none."""
    if routed_experts and out.routed_experts is None and out.finish_reason != "abort":
        raise ValueError(
            "the engine returned no routed_experts though rollout.return_routed_experts asked "
            "for them: a dense model reports none, an SGLang server needs "
            "--enable-return-routed-experts, and vLLM does not report them"
        )
    sample.routed_experts = out.routed_experts
    sample.tokens = sample.prompt_tokens + list(out.output_ids)
    sample.response_length = len(out.output_ids)
    sample.loss_mask = [1] * len(out.output_ids)
    sample.rollout_logprobs = list(out.output_token_logprobs)
    sample.status = STATUS_OF_FINISH[out.finish_reason]
    sample.weight_versions = output_versions(out)
    sample.metadata["response_text"] = response_text


def generate_groups(
    engine: Generator,
    decode: Callable[[list[int]], str],
    groups: list[Group],
    params: SamplingParams,
    *,
    routed_experts: bool = False,
) -> list[Group]:
    """Generate every sample in one engine call and fill it in place (with multi-LoRA, each
    with its adapter; with `routed_experts`, each with the experts its tokens were routed to)."""
    samples = [sample for group in groups for sample in group]
    requests = [
        GenerateRequest(
            input_ids=s.prompt_tokens,
            sampling_params=params,
            lora_path=s.adapter,
            return_routed_experts=routed_experts,
        )
        for s in samples
    ]
    for sample, out in zip(samples, engine.generate(requests), strict=True):
        fill_sample(sample, out, decode(out.output_ids), routed_experts=routed_experts)
    return groups
