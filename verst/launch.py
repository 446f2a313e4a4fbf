"""Builds the components of a run from its config and wires them together.

- the policy models (`verst.train.policy`): trainer, shell, reference, critic;
- the engine: placement `embedded` (the default) runs the continuous-batching `Scheduler` in
  the trainer's process, called directly, whose weights are the trainer's own tensors when
  dtypes allow; placements `in_process` and `processes` put serving engines behind a router
  (`verst.fleet.fleet.Fleet`);
- weight sync from the trainer to the engine (`verst.sync`);
- the rollout source (`verst.rollout.source`), the reward scorer, the prompt ledger
  (`run_dir/prompts.jsonl`), the evaluator, the checkpointer and the warm start's pieces.

Nothing here runs the loop: `verst.loop` does, in terms of these components.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verst import distributed
from verst.config import RunConfig
from verst.data.source import DataSource, DataSourceConfig, adapter_rows
from verst.engine import Scheduler
from verst.envs.runner import EnvironmentAgent
from verst.eval.build import build_eval_points, default_set, set_evaluator
from verst.eval.evaluate import Evaluator, SetEvaluators
from verst.eval.points import EvalPoints
from verst.fleet.fleet import Fleet
from verst.fleet.ranked import RankedFleet
from verst.models.loading import eos_token_ids, load_model_and_tokenizer, load_model_config
from verst.models.lora import POLICY_ADAPTER, apply_lora
from verst.monitor.engine_stats import EngineSampler
from verst.monitor.samples import SampleRecorder
from verst.plugins import AgentFunction, Generator, RewardFunction
from verst.rollout.agent import load_agent_fn
from verst.rollout.ledger import LEDGER_FILE, Ledger
from verst.rollout.rewards import AdapterRewards, RewardScorer, load_reward_fn
from verst.rollout.source import (
    AgentRollout,
    AsyncRollout,
    EngineRollout,
    FunctionRollout,
    RolloutSource,
)
from verst.rollout.teacher import TeacherScorer
from verst.sync.embedded import EmbeddedSync
from verst.sync.fleet_sync import FleetSync
from verst.train.algorithms import LossConfig
from verst.train.batching import TrainItem
from verst.train.checkpoint import Checkpointer
from verst.train.megatron.config import check_layout
from verst.train.policy import PolicyModels
from verst.train.sft_data import load_examples
from verst.train.trainer import Trainer, compute_dtype

ENGINE_INIT_DIR = "engine_init"


@dataclass
class Run:
    cfg: RunConfig
    run_dir: Path
    device: torch.device
    policy: PolicyModels
    engine: Generator  # what the rollout and the evaluator generate with
    sync: EmbeddedSync | FleetSync
    rollout: RolloutSource
    rewards: RewardScorer
    ledger: Ledger
    checkpointer: Checkpointer
    evals: EvalPoints
    warm_start_items: list[TrainItem] | None
    dev_accuracy: Callable[[], float]
    fleet: Fleet | None = None
    teacher: TeacherScorer | None = None  # loss.opd's teachers
    engine_stats: EngineSampler = field(default_factory=lambda: EngineSampler(dict))
    samples: SampleRecorder | None = None  # a few samples a step, for verst dashboard

    def close(self) -> None:
        self.evals.close()
        self.rollout.close()
        if isinstance(self.sync, FleetSync):
            self.sync.close()
        if self.fleet is not None:
            self.fleet.close()


def load_policy(
    cfg: RunConfig,
) -> tuple[torch.device, PreTrainedModel, PreTrainedModel, PreTrainedTokenizerBase]:
    """This process's threads, device, process group and seeds, then the policy: (device, the
    model to train, with its LoRA adapters when `model.lora` is on, an unadapted copy of it to
    save checkpoints through, the tokenizer)."""
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    device = distributed.resolve_device(cfg.trainer.device)
    distributed.init_distributed(device)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.trainer.backend == "megatron":  # a layout that cannot fit fails before any weights load
        check_layout(cfg.trainer.megatron, load_model_config(cfg.model), distributed.world_size())
    model, tokenizer = load_model_and_tokenizer(cfg.model, seed=cfg.seed)
    # the shell stays in host memory: it only lends its structure to saves, the reference and
    # the critic, and a device copy would hold a whole fp32 model of device memory for that
    shell = copy.deepcopy(model)
    model.to(device)
    if cfg.model.lora.enabled:
        apply_lora(model, cfg.model.lora)
    return device, model, shell, tokenizer


def make_trainer(
    cfg: RunConfig,
    model: PreTrainedModel,
    pad_token_id: int,
    device: torch.device,
    *,
    sft_steps: int | None = None,
) -> Trainer:
    """The policy trainer of `trainer.backend`: FSDP2, or Megatron-core (same interface).
    `sft_steps`: the supervised trainer of `mode: sft` (no RL loss, temperature 1), for a
    schedule of that many steps."""
    sft = sft_steps is not None
    loss = LossConfig() if sft else cfg.loss
    common = dict(
        total_steps=sft_steps if sft else cfg.num_steps,
        pad_token_id=pad_token_id,
        temperature=1.0 if sft else cfg.rollout.temperature,
        constant_normaliser=cfg.loss.constant_normaliser or float(cfg.rollout.max_new_tokens),
        device=device,
    )
    if cfg.trainer.backend == "megatron":
        from verst.train.megatron.trainer import MegatronTrainer  # megatron-core: an extra

        return MegatronTrainer(model, cfg.trainer, loss, seed=cfg.seed, **common)  # type: ignore[return-value]
    lora = cfg.model.lora
    adapter_lrs = None if sft else {a.name: a.lr or cfg.trainer.lr for a in lora.adapters} or None
    return Trainer(model, cfg.trainer, loss, adapter_lrs=adapter_lrs, **common)


def build(cfg: RunConfig, run_dir: Path) -> Run:
    device, model, shell, tokenizer = load_policy(cfg)
    teacher = None
    if cfg.loss.opd is not None:  # checked before any engine starts: a bad teacher fails fast
        teacher = TeacherScorer(cfg.loss.opd, tokenizer.encode, temperature=cfg.rollout.temperature)
        teacher.check()
    # the embedded engine's copy carries the same adapter and applies it itself; serving
    # engines, and every engine of a multi-LoRA run, start from the frozen base and hold the
    # adapters in their registry
    lora = cfg.model.lora
    registry = lora.enabled and (cfg.placement.serving or bool(lora.adapters))
    engine_model = copy.deepcopy(shell if registry else model)
    engine_model = engine_model.to(dtype=compute_dtype(cfg.trainer.dtype, device)).eval()
    trainer = make_trainer(cfg, model, tokenizer.pad_token_id, device)
    policy = PolicyModels(trainer, shell, cfg.loss, run_dir, cfg.model.lora)
    engine, sync, fleet = build_engine(cfg, run_dir, engine_model, policy, tokenizer)
    try:
        run = wire(cfg, run_dir, device, policy, tokenizer, engine, sync, fleet)
    except BaseException:
        if fleet is not None:
            fleet.close()
        raise
    run.teacher = teacher
    return run


def wire(
    cfg: RunConfig,
    run_dir: Path,
    device: torch.device,
    policy: PolicyModels,
    tokenizer: PreTrainedTokenizerBase,
    engine: Generator,
    sync: EmbeddedSync | FleetSync,
    fleet: Fleet | None,
) -> Run:
    """The rollout source, rewards, evaluators and checkpointer around a built engine."""
    timeout_s = cfg.rollout.reward_timeout_s
    group_fn = cfg.rollout.load_group_reward()
    rewards = RewardScorer(rollout_reward(cfg), timeout_s=timeout_s, group_fn=group_fn)
    ledger = Ledger(run_dir / LEDGER_FILE)
    eos_ids = eos_token_ids(policy.shell, tokenizer)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    warm = cfg.warm_start
    dev_evaluator = build_evaluator(cfg, warm.dev_data, rewards.fn, tokenizer, decode, device)

    def dev_accuracy() -> float:
        sync.push(int(engine.weight_version) + 1)  # every weight change is a new version
        return dev_evaluator.run(engine)["eval/accuracy"]

    data = training_prompts(cfg, tokenizer)
    adapters = cfg.eval.interval_steps > 0 and cfg.model.lora.adapters
    evaluator = adapter_evaluators(cfg, rewards.fn, tokenizer, decode, device) if adapters else None
    rollout = rollout_source(
        cfg, (cfg.rollout, data, rewards, device, ledger), engine, fleet, decode
    )
    checkpointer = Checkpointer(
        cfg.checkpoint,
        run_dir,
        policy=policy,
        tokenizer=tokenizer,
        data_state=rollout.data_state,
        load_data_state=data.load_state_dict,
        engine_generator=engine.generator if isinstance(engine, Scheduler) else None,
    )
    evals = build_eval_points(
        cfg,
        run_dir,
        policy=policy,
        tokenizer=tokenizer,
        decode=decode,
        device=device,
        engine_dtype=compute_dtype(cfg.trainer.dtype, device),
        rollout_reward_fn=rewards.fn,
        engine=engine,
        paused=rollout.paused,
        checkpoint_due=lambda step, last: checkpointer.due(step, last=last),
        shared=evaluator,
    )
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        device=device,
        policy=policy,
        engine=engine,
        sync=sync,
        rollout=rollout,
        rewards=rewards,
        ledger=ledger,
        checkpointer=checkpointer,
        evals=evals,
        warm_start_items=load_examples(warm.data, warm.format, tokenizer, eos_ids[0])[0]
        if warm.enabled
        else None,
        dev_accuracy=dev_accuracy,
        fleet=fleet,
        engine_stats=EngineSampler.for_engine(engine, fleet),
        samples=SampleRecorder(run_dir, cfg.monitor.samples_per_step, tokenizer.decode),
    )


def rollout_source(
    cfg: RunConfig,
    parts: tuple,
    engine: Generator,
    fleet: Fleet | None,
    decode: Callable[[list[int]], str],
) -> RolloutSource:
    """Where the run's groups come from: the fully async worker, an agent (or environment) on
    sessions, the rollout function, or the engine's batched generation."""
    agent_fn = agent_function(cfg)
    if cfg.mode == "fully_async":
        return AsyncRollout(*parts, fleet=fleet, decode=decode, agent_fn=agent_fn)
    if agent_fn is not None:
        return AgentRollout(*parts, fleet=fleet, agent_fn=agent_fn)
    if cfg.rollout.function:
        return FunctionRollout(*parts, engine=engine, decode=decode)
    return EngineRollout(*parts, engine=engine, decode=decode)


def agent_function(cfg: RunConfig) -> AgentFunction | None:
    """What plays multi-turn samples: the environment of `env.name`, the agent function of
    `rollout.agent_function`, or nothing (single-turn generation)."""
    if cfg.env.name is not None:
        return EnvironmentAgent(cfg.env)
    if cfg.rollout.agent_function:
        return load_agent_fn(cfg.rollout.agent_function)
    return None


def rollout_reward(cfg: RunConfig) -> RewardFunction:
    """`rollout.reward`; with multi-LoRA each adapter's own (`AdapterRewards`)."""
    adapters = cfg.model.lora.adapters
    if not adapters:
        return load_reward_fn(cfg.rollout.reward)
    return AdapterRewards(
        {
            a.name: load_reward_fn(
                a.reward or cfg.rollout.reward, field=f"model.lora.adapters[{a.name}].reward"
            )
            for a in adapters
        }
    )


def training_prompts(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> DataSource:
    """`data`'s prompts; with multi-LoRA every adapter's, as one shuffled set of tagged rows."""
    n, seed = cfg.rollout.n_samples_per_prompt, cfg.seed
    adapters = cfg.model.lora.adapters
    if not adapters:
        return DataSource(cfg.data, tokenizer, n_samples_per_prompt=n, seed=seed)
    mixed, rows = adapter_rows({a.name: a.data for a in adapters})
    return DataSource(mixed, tokenizer, n_samples_per_prompt=n, seed=seed, rows=rows)


def build_evaluator(
    cfg: RunConfig,
    data_cfg: DataSourceConfig,
    rollout_reward_fn: RewardFunction,
    tokenizer: PreTrainedTokenizerBase,
    decode: Callable[[list[int]], str],
    device: torch.device,
    *,
    adapter: str | None = None,
) -> Evaluator:
    """Greedy evaluation of `data_cfg`'s prompts with the default set's options, scored by
    `eval.reward` (else the rollout's reward); with `adapter`, generated with that LoRA adapter
    (`eval/<adapter>/...`)."""
    rows = None if adapter is None else adapter_rows({adapter: data_cfg})[1]
    return set_evaluator(
        default_set(cfg.eval, data_cfg),
        rollout_reward_fn,
        tokenizer,
        decode,
        device,
        seed=cfg.seed,
        reward_timeout_s=cfg.rollout.reward_timeout_s,
        prefix="eval" if adapter is None else f"eval/{adapter}",
        rows=rows,
    )


def adapter_evaluators(
    cfg: RunConfig,
    rewards: RewardFunction,
    tokenizer: PreTrainedTokenizerBase,
    decode: Callable[[list[int]], str],
    device: torch.device,
) -> SetEvaluators:
    """Multi-LoRA: every adapter with `eval_data`, on its prompts with its reward (of the
    rollout's `AdapterRewards`)."""
    assert isinstance(rewards, AdapterRewards)
    return SetEvaluators(
        {
            a.name: build_evaluator(
                cfg, a.eval_data, rewards.fns[a.name], tokenizer, decode, device, adapter=a.name
            )
            for a in cfg.model.lora.adapters
            if a.eval_data is not None
        }
    )


def build_engine(
    cfg: RunConfig,
    run_dir: Path,
    engine_model: PreTrainedModel,
    policy: PolicyModels,
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[Generator, EmbeddedSync | FleetSync, Fleet | None]:
    """The engine the rollout generates with, the weight sync that feeds it, and the fleet
    (rank 0's) when engines serve."""
    trainer = policy.trainer
    if not cfg.placement.serving:
        eos_ids = eos_token_ids(policy.shell, tokenizer)
        scheduler = Scheduler.for_model(
            engine_model,
            eos_token_ids=eos_ids,
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else eos_ids[0],
            max_running=cfg.placement.max_batch_size,
            seed=cfg.seed + distributed.rank(),
            tokenizer=tokenizer,
            true_on_policy=cfg.trainer.true_on_policy,
            quantization=cfg.engine.quantization,
            overlap=cfg.engine.scheduler_overlap(),
        )
        return scheduler, EmbeddedSync(trainer, scheduler, lora=cfg.model.lora), None
    fleet = None
    if distributed.rank() == 0:
        fleet = start_fleet(cfg, run_dir, engine_model, policy.shell, tokenizer, trainer.device)
        if cfg.model.lora.enabled and not cfg.model.lora.adapters:
            fleet.lora_path = POLICY_ADAPTER  # each request runs with the adapter pushed
        fleet.routed_experts = cfg.rollout.return_routed_experts
    distributed.barrier()
    engine = fleet if distributed.world_size() == 1 else RankedFleet(fleet)
    try:
        sync = FleetSync.build(
            cfg.sync,
            placement=cfg.placement,
            pause_mode=cfg.pause_mode,
            trainer=trainer,
            fleet=fleet,
            generator=engine,
            engine_dtype=next(engine_model.parameters()).dtype,
            run_dir=run_dir,
            lora=cfg.model.lora,
        )
    except BaseException:
        if fleet is not None:
            fleet.close()
        raise
    return engine, sync, fleet


def start_fleet(
    cfg: RunConfig,
    run_dir: Path,
    engine_model: PreTrainedModel,
    shell: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
) -> Fleet:
    """Serving engines with the initial policy: in-process engines take `engine_model`, engine
    processes load it from `run_dir/engine_init` (their weights come through sync later)."""
    model_dir = run_dir / ENGINE_INIT_DIR
    placement = cfg.placement
    if placement.engines == "processes":
        shell.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        # engine processes take seconds to import and load; say what the wait is for
        print(
            f"verst: starting {placement.num_engines} engine process(es) "
            f"({placement.mode}); their logs are named in any start-up error",
            file=sys.stderr,
            flush=True,
        )
    return Fleet.start(
        cfg.placement,
        model=engine_model,
        tokenizer=tokenizer,
        model_dir=model_dir,
        trainer_device=device,
        dtype=next(engine_model.parameters()).dtype,
        seed=cfg.seed,
        fault_tolerance=cfg.fault_tolerance,
        true_on_policy=cfg.trainer.true_on_policy,
        quantization=cfg.engine.quantization,
        overlap=cfg.engine.scheduler_overlap(),
    )
