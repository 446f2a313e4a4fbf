"""The root config: composes each part's section, loads YAML, applies dotted overrides, prints help.

`load_config("examples/quickstart.yaml", ["trainer.lr=1e-5"])` returns a validated `RunConfig`
or raises `ConfigError` whose message names the offending field, before any work starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from verst.config_checks import RunConfigChecks
from verst.configbase import ConfigBase
from verst.data.source import DataSourceConfig
from verst.diffusion.config import DiffusionConfig
from verst.engine.config import EngineConfig
from verst.envs.runner import EnvConfig
from verst.eval.config import EvalConfig
from verst.fleet.health import FaultToleranceConfig
from verst.fleet.placement import PlacementConfig
from verst.models.loading import ModelConfig
from verst.models.tiny import TinyModelConfig
from verst.monitor.config import MonitorConfig
from verst.rollout.generate import RolloutConfig
from verst.rundir import writing
from verst.sync.fleet_sync import SyncConfig
from verst.train.algorithms import LossConfig
from verst.train.checkpoint import CheckpointConfig
from verst.train.sft import SFTConfig, WarmStartConfig
from verst.train.trainer import TrainerConfig


class ConfigError(ValueError):
    """A config value or combination is invalid; the message names the field."""


class RunConfig(ConfigBase, RunConfigChecks):
    seed: int = Field(0, description="seed for model init, data order, sampling and dropout")
    num_steps: int = Field(100, ge=1, description="RL steps (rollout → train → sync) to run")
    mode: Literal["sync", "fully_async", "sft"] = Field(
        "sync",
        description="sync = rollout, train and sync in turn; fully_async = engines generate "
        "continuously on their own devices while the trainer consumes finished groups; sft = "
        "supervised fine-tuning on the sft section's data (no rollout)",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads per process; unset = torch's default"
    )
    model: ModelConfig = Field(
        default_factory=lambda: ModelConfig(tiny=TinyModelConfig()), description="the policy model"
    )
    data: DataSourceConfig = Field(
        default_factory=lambda: DataSourceConfig(task="addition"),
        description="training prompts",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="generation")
    loss: LossConfig = Field(default_factory=LossConfig, description="RL objective")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="optimiser")
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="where the rollout engines run"
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="how verst's rollout engines compute"
    )
    sync: SyncConfig = Field(default_factory=SyncConfig, description="weight transport")
    warm_start: WarmStartConfig = Field(
        default_factory=WarmStartConfig, description="optional SFT before RL"
    )
    sft: SFTConfig = Field(
        default_factory=SFTConfig, description="supervised fine-tuning (mode: sft)"
    )
    env: EnvConfig = Field(
        default_factory=EnvConfig,
        description="a multi-turn environment played through the agent-function layer",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    diffusion: DiffusionConfig = Field(
        default_factory=DiffusionConfig, description="diffusion RL (model.kind: diffusion)"
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="checkpoint cadence"
    )
    fault_tolerance: FaultToleranceConfig = Field(
        default_factory=FaultToleranceConfig,
        description="engine health checks and restarts",
    )
    monitor: MonitorConfig = Field(
        default_factory=MonitorConfig, description="metric sinks and traces"
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> RunConfig:
        estimator = self.loss.advantage_estimator
        if self.rollout.n_samples_per_prompt < 2 and self.loss.estimator.group_relative:
            raise ValueError(
                f"rollout.n_samples_per_prompt must be >= 2 for {estimator}: advantages are "
                "relative to the group, so a group of one has advantage 0 and learns nothing"
            )
        self._check_diffusion()
        self._check_placement()
        self._check_ray_transport()
        self._check_no_reward()
        self._check_multi_lora()
        self._check_eval()
        self._check_megatron()
        self._check_routing_replay()
        self._check_true_on_policy()
        self.engine.check(
            true_on_policy=self.trainer.true_on_policy,
            kind=self.model.kind,
            family=self.model.tiny.family if self.model.tiny else None,
            fp32_on_cuda=self.trainer.dtype == "float32" and self.trainer.device.startswith("cuda"),
        )
        return self

    @property
    def plays_agents(self) -> str | None:
        """The field that makes rollouts multi-turn (an agent function or an environment)."""
        if self.env.name is not None:
            return "env.name"
        return "rollout.agent_function" if self.rollout.agent_function else None

    @property
    def pause_mode(self) -> str:
        """`rollout.pause_mode`, or its default for the loop mode when unset."""
        if self.rollout.pause_mode is not None:
            return self.rollout.pause_mode
        return "in_place" if self.mode == "fully_async" else "retract"


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`a.b=1` → ("a.b", 1); values are parsed as YAML, so `x=null`, `x=[1,2]` work."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        parsed.append((key.strip(), yaml.safe_load(raw) if raw else ""))
    return parsed


def _format_validation_error(error: ValidationError) -> str:
    lines = []
    for detail in error.errors():
        field = ".".join(str(part) for part in detail["loc"]) or "(root)"
        message = detail["msg"].removeprefix("Value error, ")
        # a plug-in's error already names its field (it is raised for any caller)
        lines.append(
            f"  {message}" if message.startswith(f"{field}: ") else f"  {field}: {message}"
        )
    return "invalid config:\n" + "\n".join(lines)


def merge_with_defaults(
    defaults: dict[str, Any], given: dict[str, Any], section: type[BaseModel]
) -> dict[str, Any]:
    """Deep-merge what the user gave over a section's defaults.

    A section may name `exclusive_fields` (alternatives such as a file path or a procedural
    task): when the user sets any of them, the defaults of all of them are dropped, so choosing
    `data.path` replaces the default task instead of colliding with it.
    """
    merged = dict(defaults)
    exclusive = getattr(section, "exclusive_fields", ())
    if any(name in given for name in exclusive):
        for name in exclusive:
            merged.pop(name, None)
    for name, value in given.items():
        field = section.model_fields.get(name)
        child = _section_type(field.annotation) if field is not None else None
        if child is not None and isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = merge_with_defaults(merged[name], value, child)
        else:
            merged[name] = value
    return merged


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    """Validate `tree` (YAML + overrides) merged over the default config."""
    try:
        defaults = RunConfig().model_dump()
        return RunConfig.model_validate(merge_with_defaults(defaults, tree, RunConfig))
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        tree = loaded or {}
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    return config_from_dict(tree)


def dump_config(cfg: RunConfig, path: Path) -> None:
    with writing(path):
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def _section_type(annotation: Any) -> type[BaseModel] | None:
    candidates = get_args(annotation) if get_origin(annotation) is not None else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def describe_fields(
    section: BaseModel | None = None, prefix: str = ""
) -> list[tuple[str, str, str]]:
    """(dotted name, default, description) for every leaf field of the default config."""
    section = section if section is not None else RunConfig()
    rows = []
    for name, field in type(section).model_fields.items():
        dotted = f"{prefix}{name}"
        if field.is_required():  # in an item of a list, or of an optional section
            rows.append((dotted, "required", field.description or ""))
            continue
        value = getattr(section, name)
        section_type = _section_type(field.annotation)
        if isinstance(value, BaseModel):
            rows.extend(describe_fields(value, prefix=f"{dotted}."))
        elif section_type is not None and isinstance(value, list):  # a list of sections
            rows.append((dotted, _show(value), field.description or ""))
            rows.extend(describe_fields(section_type.model_construct(), prefix=f"{dotted}[]."))
        elif section_type is not None:  # an optional section, unset by default
            rows.append((dotted, "null", field.description or ""))
            # its fields as they are once it is set (built unvalidated: a section may require
            # a value, such as loss.opd's teachers, that has no useful default)
            rows.extend(describe_fields(section_type.model_construct(), prefix=f"{dotted}."))
        else:
            rows.append((dotted, _show(value), field.description or ""))
    return rows


def help_text() -> str:
    rows = describe_fields()
    width = max(len(name) for name, _, _ in rows)
    return "\n".join(
        f"  {name:<{width}}  {desc} [default: {default}]" for name, default, desc in rows
    )
