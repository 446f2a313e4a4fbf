"""The config of the rollout's plug-in layers (`RolloutConfig` inherits it) and their loading.

From the outermost in: `function` (a whole step), `generate_function` (one sample's tokens and
episode loop), `agent_function` (the episode loop, through the OpenAI API of a session; in
`AgentConfig`). An outer layer takes over what the inner ones do, so naming two of them is a
config error. Beside them: `group_reward` (scores a whole group, in place of `reward`) and
`filter` (keeps or drops a scored group; `dynamic_sampling: true` is the built-in
`reward_variance`). Every plug-in is imported and checked against its `verst.plugins`
Protocol when the config is read, so a bad one is an error naming its field.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from verst.configbase import ConfigBase
from verst.plugin_loader import load_plugin
from verst.plugins import GenerateFunction, GroupRewardFunction, RolloutFunction, SampleFilter
from verst.rollout.dynamic import load_filter
from verst.rollout.group_reward import HTTP, load_group_reward


class LayersConfig(ConfigBase):
    """The rollout function, generate function, group reward and filter fields."""

    function: str | None = Field(
        None,
        description="rollout function 'pkg.mod:fn' (context, request) -> RolloutResult that "
        "owns a whole step: prompts, generation, rewards, filtering (sync mode); unset = built-in",
    )
    generate_function: str | None = Field(
        None,
        description="generate function 'pkg.mod:fn', async (engine, sample, params, decode) -> "
        "Sample that owns one sample's tokens and episode loop; unset = one engine call",
    )
    group_reward: str | None = Field(
        None,
        description="score each group in one call, in place of rollout.reward: 'http' (posts to "
        "rollout.group_reward_url) or 'pkg.mod:fn' (group) -> list of rewards",
    )
    group_reward_url: str | None = Field(
        None, description="with group_reward=http: the URL each group is posted to"
    )
    dynamic_sampling: bool = Field(
        False,
        description="drop groups whose rewards are all equal and sample more (DAPO): the "
        "filter reward_variance",
    )
    max_sampling_rounds: int = Field(
        4, ge=1, description="with a filter: most rounds of prompts drawn per step (sync mode)"
    )
    filter: str | None = Field(
        None,
        description="keep or drop each scored group: 'reward_variance' (DAPO dynamic sampling) "
        "or 'pkg.mod:fn' (group) -> None to keep, or the reason to drop",
    )

    @field_validator("function")
    @classmethod
    def _function_importable(cls, value: str | None) -> str | None:
        if value is not None:
            load_plugin(value, RolloutFunction, field="rollout.function")
        return value

    @field_validator("generate_function")
    @classmethod
    def _generate_importable(cls, value: str | None) -> str | None:
        if value is not None:
            load_plugin(value, GenerateFunction, field="rollout.generate_function")
        return value

    @field_validator("filter")
    @classmethod
    def _filter_importable(cls, value: str | None) -> str | None:
        if value is not None:
            load_filter(value)
        return value

    @model_validator(mode="after")
    def _group_reward_loads(self) -> LayersConfig:
        if self.group_reward is not None:
            load_group_reward(self.group_reward, self.group_reward_url)
        elif self.group_reward_url is not None:
            raise ValueError(
                f"rollout.group_reward_url is set but rollout.group_reward is not {HTTP!r}: set "
                "rollout.group_reward=http, or drop the URL"
            )
        if self.group_reward not in (None, HTTP) and self.group_reward_url is not None:
            raise ValueError("rollout.group_reward_url is only for rollout.group_reward=http")
        return self

    def load_generate_function(self) -> GenerateFunction | None:
        if self.generate_function is None:
            return None
        return load_plugin(
            self.generate_function, GenerateFunction, field="rollout.generate_function"
        )

    def load_function(self) -> RolloutFunction | None:
        if self.function is None:
            return None
        return load_plugin(self.function, RolloutFunction, field="rollout.function")

    def load_group_reward(self) -> GroupRewardFunction | None:
        if self.group_reward is None:
            return None
        return load_group_reward(self.group_reward, self.group_reward_url)

    def filter_path(self) -> str | None:
        """`filter`, or the built-in `reward_variance` when `dynamic_sampling` asks for it."""
        if self.dynamic_sampling:
            return "reward_variance"
        return self.filter

    def load_filter(self) -> SampleFilter | None:
        path = self.filter_path()
        return load_filter(path) if path is not None else None
