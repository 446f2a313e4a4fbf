"""The `eval` section: when, where and on what the policy is evaluated.

Three modes (`eval.mode`):
- `shared`: on the rollout engines, inside the step (in fully async mode the rollout worker
  stops starting trajectories, lets those in flight finish into the buffer, and resumes after);
- `fleet`: on a fleet of engine processes of its own, from a snapshot of the step's weights,
  fire-and-forget (`verst.eval.dispatch`);
- `external`: a user function `evaluate_checkpoint(checkpoint_dir, request) -> scores` on the
  snapshot, fire-and-forget.

Every requirement of a mode is checked here, at config time, naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from verst.configbase import ConfigBase
from verst.data.source import DataSourceConfig
from verst.plugin_loader import load_plugin
from verst.plugins import CheckpointEvalFunction
from verst.rollout.rewards import load_reward_fn

EvalMode = Literal["shared", "fleet", "external"]
SNAPSHOT_MODES = ("fleet", "external")


class EvalSetConfig(ConfigBase):
    name: str = Field(
        ..., pattern=r"^[A-Za-z0-9_.-]+$", description="the set's name, in its metrics"
    )
    data: DataSourceConfig = Field(..., description="the set's prompts (read in file order)")
    reward: str | None = Field(None, description="reward function; unset = the rollout's reward")
    n_samples: int = Field(1, ge=1, description="samples per prompt (k of pass@k and mean@k)")
    temperature: float = Field(0.0, ge=0, description="sampling temperature; 0 = greedy")
    max_new_tokens: int = Field(256, ge=1, description="response length limit")

    @field_validator("reward")
    @classmethod
    def _reward_importable(cls, value: str | None) -> str | None:
        if value is not None:
            load_reward_fn(value, field="eval.sets[].reward")
        return value


class EvalConfig(ConfigBase):
    interval_steps: int = Field(
        0,
        ge=0,
        description="evaluate every N RL steps, before the first and after the last; 0 = never",
    )
    mode: EvalMode = Field(
        "shared",
        description="shared = on the rollout engines, inside the step; fleet = on engine "
        "processes of its own from a snapshot, in the background; external = eval.function on "
        "the snapshot's directory, in the background",
    )
    data: DataSourceConfig = Field(
        default_factory=lambda: DataSourceConfig(task="addition", split="test", shuffle=False),
        description="held-out prompts of the default set (used when eval.sets is empty)",
    )
    max_new_tokens: int = Field(256, ge=1, description="response length limit of the default set")
    temperature: float = Field(0.0, ge=0, description="default set's temperature; 0 = greedy")
    n_samples: int = Field(1, ge=1, description="default set's samples per prompt (pass@k's k)")
    reward: str | None = Field(
        None, description="default set's reward function; unset = the rollout's reward"
    )
    sets: list[EvalSetConfig] = Field(
        default_factory=list,
        description="named evaluation sets (metrics eval/<name>/*); empty = the default set "
        "(metrics eval/*) from eval.data, eval.reward, ...",
    )
    function: str | None = Field(
        None,
        description="mode external: evaluate_checkpoint(checkpoint_dir, request) -> scores, by "
        "import path (pkg.mod:fn); may raise verst.plugins.EvalSkip(reason)",
    )
    max_in_flight: int = Field(
        2, ge=1, description="snapshot modes: most evaluations pending (queued or running)"
    )
    overflow: Literal["backpressure", "skip"] = Field(
        "backpressure",
        description="snapshot modes, when max_in_flight are pending: backpressure = the step "
        "waits for one to finish; skip = the point is skipped (eval/skipped_busy), never the last",
    )
    keep_snapshots: int = Field(
        2, ge=1, description="snapshot exports kept on disk (only verst's own exports are removed)"
    )
    snapshot_timeout_s: float = Field(
        600.0, gt=0, description="how long an evaluation waits for a checkpoint's .complete marker"
    )
    nice: int = Field(
        10,
        ge=0,
        le=19,
        description="snapshot modes: CPU scheduling niceness of the evaluation's processes (the "
        "fleet's engines, the external function's process), so training keeps the CPU; 0 = none",
    )
    num_engines: int = Field(1, ge=0, description="mode fleet: engine processes of the eval fleet")
    engine_devices: list[str] = Field(
        default_factory=list,
        description="mode fleet: device of each eval engine (cycled), e.g. [cuda:3] or [cpu]",
    )
    engine_threads: int | None = Field(
        None, ge=1, description="mode fleet: torch CPU threads per eval engine; unset = placement's"
    )
    pin_timeout_s: float = Field(
        600.0, gt=0, description="mode fleet: seconds to load a snapshot and confirm its version"
    )

    @field_validator("reward")
    @classmethod
    def _reward_importable(cls, value: str | None) -> str | None:
        if value is not None:
            load_reward_fn(value, field="eval.reward")
        return value

    @field_validator("function")
    @classmethod
    def _function_importable(cls, value: str | None) -> str | None:
        if value is not None:
            load_plugin(value, CheckpointEvalFunction, field="eval.function")
        return value

    @model_validator(mode="after")
    def _mode_requirements(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.sets: names must be distinct, got {names}")
        if self.mode in SNAPSHOT_MODES and self.interval_steps == 0:
            raise ValueError(
                f"eval.interval_steps: eval.mode={self.mode} evaluates snapshots every N steps; "
                "set eval.interval_steps >= 1"
            )
        if self.mode == "external" and self.function is None:
            raise ValueError(
                "eval.function: eval.mode=external needs the function to call, e.g. "
                "mypkg.evals:evaluate_checkpoint"
            )
        if self.mode != "external" and self.function is not None:
            raise ValueError(f"eval.function is only called by eval.mode=external, not {self.mode}")
        if self.mode == "fleet" and self.num_engines < 1:
            raise ValueError("eval.num_engines: eval.mode=fleet needs at least one engine")
        if self.mode == "fleet" and not self.engine_devices:
            raise ValueError(
                "eval.engine_devices: eval.mode=fleet needs the eval engines' devices, apart "
                "from the rollout's (e.g. [cuda:3], or [cpu])"
            )
        return self

    @property
    def snapshot(self) -> bool:
        """Evaluations run in the background on a snapshot (fleet, external)."""
        return self.mode in SNAPSHOT_MODES

    def eval_sets(self) -> list[EvalSetConfig]:
        """`sets`, or the default set (named "": metrics `eval/*`) from the top-level fields."""
        return list(self.sets) or [self.default_set(self.data, n_samples=self.n_samples)]

    def default_set(self, data: DataSourceConfig, *, n_samples: int) -> EvalSetConfig:
        """The top-level options (reward, temperature, max_new_tokens) on `data`."""
        return EvalSetConfig.model_construct(
            name="",
            data=data,
            reward=self.reward,
            n_samples=n_samples,
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
        )
