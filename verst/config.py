"""The root config: composes each part's section, loads YAML, applies dotted overrides, prints help.

`load_config("examples/quickstart.yaml", ["trainer.lr=1e-5"])` returns a validated `RunConfig`
or raises `ConfigError` whose message names the offending field, before any work starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from verst.configbase import ConfigBase
from verst.data.source import DataSourceConfig
from verst.diffusion.config import DiffusionConfig
from verst.engine.config import EngineConfig
from verst.envs.runner import EnvConfig
from verst.eval.config import EvalConfig
from verst.fleet.health import FaultToleranceConfig
from verst.fleet.placement import PlacementConfig
from verst.models.families import MOE_FAMILIES
from verst.models.invariant_forward import TRUE_ON_POLICY_FAMILIES
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


class RunConfig(ConfigBase):
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
        check_diffusion(self)
        check_placement(self)
        check_ray_transport(self)
        check_no_reward(self)
        check_multi_lora(self)
        check_eval(self)
        check_megatron(self)
        check_routing_replay(self)
        check_true_on_policy(self)
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


def check_megatron(cfg: RunConfig) -> None:
    """What the megatron backend does not train fails before any work, naming the field."""
    if cfg.trainer.backend != "megatron":
        return
    unsupported = {
        "model.lora.enabled (adapters are per HF projection; Megatron fuses q/k/v and "
        "gate/up, see docs/training_backends.md)": cfg.model.lora.enabled,
        f"loss.advantage_estimator={cfg.loss.advantage_estimator} (a PPO critic: no Megatron "
        "value model yet)": cfg.loss.needs_critic,
        "trainer.gradient_checkpointing (not wired to Megatron's recompute yet)": (
            cfg.trainer.gradient_checkpointing
        ),
        "trainer.kernels=liger (Megatron's layers are its own)": cfg.trainer.kernels == "liger",
        "trainer.offload (Megatron's optimizer is its own)": cfg.trainer.offload != "none",
    }
    for field, on in unsupported.items():
        if on:
            raise ValueError(f"trainer.backend=megatron does not support {field}; use fsdp2")


MAX_ADAPTERS = 8  # what the engines hold by default (`verst serve --max-loras-per-batch`)


def check_multi_lora(cfg: RunConfig) -> None:
    """Refuse `model.lora.adapters` settings that cannot run (each error names the field)."""
    lora = cfg.model.lora
    if not lora.adapters:
        return
    names = [a.name for a in lora.adapters]
    refusals = {
        "model.lora.rank must be >= 1 to train adapters": not lora.enabled,
        f"names must be distinct, got {names}": len(set(names)) != len(names),
        f"at most {MAX_ADAPTERS} adapters (what an engine holds)": len(names) > MAX_ADAPTERS,
        "each adapter has its own data: leave the top-level data unset": cfg.data
        != RunConfig.model_fields["data"].get_default(call_default_factory=True),
        "eval.interval_steps > 0 evaluates adapters' eval_data, and none has any": (
            cfg.eval.interval_steps > 0 and all(a.eval_data is None for a in lora.adapters)
        ),
        "every adapter's data needs the same apply_chat_template": len(
            {a.data.apply_chat_template for a in lora.adapters}
        )
        > 1,
        "a KL reference or a critic is one model; multi-LoRA has one per adapter (not yet)": (
            cfg.loss.needs_reference_model or cfg.loss.needs_critic
        ),
        "loss.opd is not supported with several adapters yet": cfg.loss.opd is not None,
        "agents and environments are not supported with several adapters yet": bool(
            cfg.plays_agents
        ),
        "warm_start would train which adapter? run verst sft for the base first": (
            cfg.warm_start.enabled
        ),
    }
    for reason, refused in refusals.items():
        if refused:
            raise ValueError(f"model.lora.adapters: {reason}")


def check_routing_replay(cfg: RunConfig) -> None:
    """`loss.routing_replay` needs the experts of every token from the rollout (it turns
    `rollout.return_routed_experts` on) and a mixture-of-experts model; a model loaded from a
    path is checked when the trainer is built."""
    if not cfg.loss.routing_replay:
        return
    if cfg.trainer.gradient_checkpointing:
        raise ValueError(
            "loss.routing_replay with trainer.gradient_checkpointing: the backward's replay of "
            "a layer would route its tokens again instead of replaying the rollout's experts"
        )
    tiny = cfg.model.tiny
    if tiny is not None and tiny.family not in MOE_FAMILIES:
        raise ValueError(
            f"loss.routing_replay replays the experts of a mixture-of-experts model, and "
            f"model.tiny.family {tiny.family!r} is dense: use one of {', '.join(MOE_FAMILIES)}"
        )
    cfg.rollout.return_routed_experts = True


def check_true_on_policy(cfg: RunConfig) -> None:
    """`trainer.true_on_policy` needs verst's own engines running the batch-invariant forward
    on the trainer's kind of device, on a model it reads; a model loaded from a path (and the
    devices `auto` picks) are checked when the engine and trainer are built."""
    if not cfg.trainer.true_on_policy:
        return
    tiny = cfg.model.tiny
    refusals = {
        "trainer.backend=megatron (its layers are Megatron's, not the invariant forward)": (
            cfg.trainer.backend == "megatron"
        ),
        "model.lora.rank > 0 (the invariant forward reads plain linear layers)": (
            cfg.model.lora.enabled
        ),
        "loss.routing_replay or rollout.return_routed_experts (the invariant forward routes "
        "by itself, without the router hooks; its routing is the engine's anyway)": (
            cfg.loss.routing_replay or cfg.rollout.return_routed_experts
        ),
        f"model.tiny.family={tiny.family if tiny else None} (covered: "
        f"{', '.join(TRUE_ON_POLICY_FAMILIES)})": (
            tiny is not None and tiny.family not in TRUE_ON_POLICY_FAMILIES
        ),
        "placement.backend=ray (engines on other hosts may run other kernels)": (
            cfg.placement.backend == "ray"
        ),
        "placement.engine_devices of another kind than trainer.device (other kernels)": any(
            not device.startswith(cfg.trainer.device) for device in cfg.placement.engine_devices
        )
        and cfg.trainer.device != "auto",
        "model.kind=diffusion": cfg.model.kind == "diffusion",
        "trainer.gradient_checkpointing (the invariant forward keeps its activations)": (
            cfg.trainer.gradient_checkpointing
        ),
        "trainer.kernels=liger (the invariant forward runs its own kernels)": (
            cfg.trainer.kernels == "liger"
        ),
    }
    for field, on in refusals.items():
        if on:
            raise ValueError(f"trainer.true_on_policy cannot be guaranteed with {field}")


def check_diffusion(cfg: RunConfig) -> None:
    """Refuse what a diffusion run cannot do (each error names the field)."""
    if cfg.model.kind != "diffusion":
        return
    if cfg.model.path is None:
        raise ValueError(
            "model.path: model.kind=diffusion loads a diffusion model directory; make one with "
            "`verst model create-tiny-diffusion DIR`"
        )
    if cfg.mode == "sft":
        raise ValueError(
            "mode=sft: a diffusion run trains by flow matching with diffusion.algorithm=sft"
        )
    if cfg.mode == "fully_async" and cfg.diffusion.algorithm == "sft":
        raise ValueError(
            "mode=fully_async with diffusion.algorithm=sft: SFT has no rollout to run ahead; "
            "use mode=sync"
        )
    lora = cfg.model.lora
    if lora.enabled and lora.adapters:
        raise ValueError("model.lora.adapters: a diffusion run trains one adapter (not yet)")
    if lora.enabled and lora.dropout > 0:
        raise ValueError(
            "model.lora.dropout: the diffusion trainer runs the model without dropout (train "
            "and rollout run the same forward); set it to 0"
        )
    check_diffusion_transport(cfg)
    evals = cfg.eval.changed_fields()
    if evals:
        raise ValueError(
            f"eval.{evals[0]}: a diffusion run evaluates every caption on its own engine "
            "(diffusion.eval_interval_steps, diffusion.eval_seeds_per_prompt); `verst eval "
            f"CHECKPOINT CONFIG` scores a saved checkpoint; leave eval.{evals[0]} unset"
        )


DIFFUSION_TRANSPORTS = {"in_process": ("colocated",), "http": ("disk", "broadcast")}


def check_diffusion_transport(cfg: RunConfig) -> None:
    """`diffusion.engine` places a diffusion run's engine and says how weights reach it (in
    process; served, through the disk or a broadcast group): a `placement`, `fault_tolerance`
    or `sync` field that the transport would ignore is refused."""
    engine = cfg.diffusion.engine
    placed = [f"placement.{name}" for name in cfg.placement.changed_fields()]
    placed += [f"fault_tolerance.{name}" for name in cfg.fault_tolerance.changed_fields()]
    if placed:
        raise ValueError(
            f"{placed[0]}: a diffusion run does not use placement or fault_tolerance; "
            f"diffusion.engine places the engine (in_process or http), so leave {placed[0]} unset"
        )
    transport, allowed = cfg.sync.transport, DIFFUSION_TRANSPORTS[engine]
    if transport not in ("auto", *allowed):
        where = "in process" if engine == "in_process" else "through the disk or a broadcast group"
        raise ValueError(
            f"sync.transport={transport}: with diffusion.engine={engine} the weights go {where} "
            f"(sync.transport={' or '.join(allowed)} or auto)"
            + (
                "; broadcast needs a served engine: diffusion.engine=http"
                if transport == "broadcast"
                else ""
            )
        )
    # a broadcast push is bucketed and confirmed; the disk and in-process ones are one piece
    used = ("transport", "bucket_mb", "max_resends") if transport == "broadcast" else ("transport",)
    tuned = [name for name in cfg.sync.changed_fields() if name not in used]
    if tuned:
        raise ValueError(
            f"sync.{tuned[0]}: a diffusion run pushes whole weights (or whole adapters) in one "
            f"piece unless sync.transport=broadcast (which takes sync.bucket_mb and "
            f"sync.max_resends); leave sync.{tuned[0]} unset"
        )


def check_eval(cfg: RunConfig) -> None:
    """Refuse evaluation modes the run cannot serve (each error names the field)."""
    if cfg.eval.mode == "fleet" and cfg.model.lora.enabled:
        raise ValueError(
            "eval.mode=fleet loads full HF snapshots; with model.lora a snapshot holds adapters "
            "only (not yet): use eval.mode shared or external"
        )
    if cfg.eval.snapshot and cfg.mode == "sft":
        raise ValueError(f"eval.mode={cfg.eval.mode} evaluates RL steps; mode=sft has none")


def check_no_reward(cfg: RunConfig) -> None:
    """Refuse `rollout.reward: none` where nothing would be learned or measured."""
    if cfg.rollout.reward != "none":
        return
    if cfg.loss.opd is None:
        raise ValueError(
            "rollout.reward=none: with no reward, only a teacher gives a signal; set "
            "loss.opd.teacher_urls (pure distillation) or choose a reward function"
        )
    if cfg.rollout.filter_path() == "reward_variance":
        raise ValueError(
            "rollout.dynamic_sampling drops groups of equal rewards, and rollout.reward=none "
            "gives every sample 0: every group would be dropped; turn one of them off"
        )
    evaluates = cfg.eval.interval_steps > 0 or cfg.warm_start.enabled
    if evaluates and cfg.eval.reward is None:
        raise ValueError(
            "eval.reward: evaluation scores with the rollout's reward when unset, and "
            "rollout.reward=none scores 0; set eval.reward (e.g. exact_match)"
        )


def check_placement(cfg: RunConfig) -> None:
    """Refuse engine placement, transport, pause mode and loop mode that cannot work together."""
    if cfg.model.kind == "diffusion":  # diffusion.engine places it: check_diffusion_transport
        return
    placement, transport = cfg.placement, cfg.sync.resolve(cfg.placement)
    lm_async = cfg.mode == "fully_async"
    if cfg.fault_tolerance.enabled and placement.engines != "processes":
        raise ValueError(
            f"fault_tolerance.enabled: engines placed {placement.engines} run in the trainer's "
            "process and cannot be restarted; use placement.engines=processes, or set "
            "fault_tolerance.enabled=false"
        )
    if lm_async and placement.mode != "disaggregated":
        raise ValueError(
            "mode=fully_async needs placement.mode=disaggregated (with placement.engines="
            "processes): colocated engines share the trainer's device, so they could not "
            "generate while it trains"
        )
    if lm_async and cfg.pause_mode == "abort":
        raise ValueError(
            "mode=fully_async needs rollout.pause_mode retract or in_place: abort would throw "
            "away every trajectory in flight at each weight update"
        )
    if lm_async and cfg.rollout.function:
        raise ValueError(
            "rollout.function owns a whole synchronous step, and mode=fully_async has none: "
            "use rollout.generate_function (one sample), or mode=sync"
        )
    if placement.sleep_engines and placement.engines != "embedded":
        raise ValueError(
            f"placement.sleep_engines releases the embedded engine's memory; engines placed "
            f"{placement.engines} keep theirs (use placement.engines=embedded)"
        )
    agents = cfg.plays_agents
    if cfg.env.name is not None and cfg.rollout.agent_function:
        raise ValueError(
            "env.name and rollout.agent_function both say what plays a sample: the environment "
            "runs as the agent function, so leave rollout.agent_function unset"
        )
    if agents and placement.engines == "embedded":
        raise ValueError(
            f"{agents} needs serving engines behind a session server: set "
            "placement.engines=in_process (or processes); the embedded engine has no chat "
            "API for an agent to call"
        )
    if agents and cfg.pause_mode == "abort":
        raise ValueError(
            f"{agents} needs rollout.pause_mode retract or in_place: abort would "
            "cut agents' turns short at every weight update"
        )
    if placement.mode == "disaggregated" and placement.engines != "processes":
        raise ValueError(
            "placement.mode=disaggregated needs placement.engines=processes: engines on devices "
            "of their own run in processes of their own"
        )
    if placement.engines == "embedded":
        if transport != "colocated":
            raise ValueError(
                f"sync.transport={transport} needs serving engines (placement.engines="
                "in_process or processes); the embedded engine is updated in place"
            )
        if placement.num_engines != 1:
            raise ValueError(
                "placement.num_engines > 1 needs placement.engines=in_process or processes"
            )
    if transport == "colocated" and placement.mode != "colocated":
        raise ValueError(
            "sync.transport=colocated needs placement.mode=colocated (engines on the trainer's "
            "device); disaggregated engines take broadcast or disk"
        )
    if transport == "broadcast" and placement.engines != "processes":
        raise ValueError(
            "sync.transport=broadcast needs placement.engines=processes: the weight-update group "
            "joins the trainer to engine processes"
        )


def check_ray_transport(cfg: RunConfig) -> None:
    """Under Ray, colocated weight sync (shared memory, CUDA IPC) needs engines on the
    trainer's node: refuse custom resources that pin them elsewhere."""
    placement = cfg.placement
    if placement.backend != "ray" or placement.engines != "processes":
        return
    if cfg.sync.resolve(placement) != "colocated":
        return
    if placement.ray_engine_resources != placement.ray_trainer_resources:
        raise ValueError(
            "sync.transport=colocated works within one node only, and placement."
            "ray_engine_resources pins engines to other nodes than placement."
            "ray_trainer_resources: use sync.transport=broadcast or disk across nodes"
        )


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
