"""Builds the components of a run from its config: model, trainer, engine, sync, data, eval.

Placement `embedded` (the default): one process (or one per rank under torchrun) holds a
trainer and a batch engine on the same device; the engine's copy of the model shares the
trainer's storage when it can. Placements `in_process` and `processes` put serving engines
behind a router (`verst.fleet.fleet.Fleet`), updated through `sync.transport`.
The `Run` also owns checkpoint save and restore, since both touch every component.
"""

from __future__ import annotations

import copy
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verst import distributed
from verst.config import RunConfig
from verst.data.source import DataSource
from verst.engine import Engine, GenerateRequest, SamplingParams
from verst.eval.evaluate import Evaluator
from verst.fleet.fleet import Fleet, LoopThread, prompt_key
from verst.fleet.ranked import RankedFleet, on_rank_zero, scatter_from_rank_zero
from verst.models.loading import eos_token_ids, load_model_and_tokenizer
from verst.rollout.agent import (
    agent_metrics,
    agent_request_kwargs,
    load_agent_fn,
    run_agent_groups,
    run_agent_sample,
    score_agent_groups,
)
from verst.rollout.async_worker import RolloutWorker, build_rollout_worker
from verst.rollout.dynamic import fill_batch, has_reward_variance
from verst.rollout.generate import fill_sample, generate_groups
from verst.rollout.metrics import rollout_metrics
from verst.rollout.rewards import load_reward_fn
from verst.sync.colocated import ColocatedSync
from verst.sync.fleet_sync import FleetSync
from verst.train.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    load_weights,
    save_checkpoint,
)
from verst.train.critic import ValueModel
from verst.train.trainer import Trainer, compute_dtype
from verst.types import Group, Sample

REFERENCE_DIR = "reference"
ENGINE_INIT_DIR = "engine_init"


@dataclass
class Run:
    cfg: RunConfig
    run_dir: Path
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    shell: PreTrainedModel  # unsharded twin of the policy, used for its config when saving
    trainer: Trainer
    engine: Engine | Fleet | RankedFleet  # what the rollout and the evaluator generate with
    sync: ColocatedSync | FleetSync
    data: DataSource
    sampling_params: SamplingParams
    reward_fn: Callable
    evaluator: Evaluator | None
    warm_start_data: DataSource | None
    dev_evaluator: Evaluator | None
    eos_ids: list[int]
    fleet: Fleet | None = None
    _worker: RolloutWorker | None = None
    _sessions_url: str | None = None
    _agent_loop: LoopThread | None = None

    def close(self) -> None:
        if self._agent_loop is not None:
            self._agent_loop.close()
        if isinstance(self.sync, FleetSync):
            self.sync.close()
        if self.fleet is not None:
            self.fleet.close()

    @property
    def rank_slice(self) -> slice:
        return slice(distributed.rank(), None, distributed.world_size())

    def draw_groups(self) -> list[Group]:
        """This rank's share of one step's prompts, generated and scored."""
        groups = self.data.take(self.cfg.rollout.prompts_per_step)[self.rank_slice]
        if self.cfg.rollout.agent_function:
            return self.run_agents(groups)
        return generate_groups(
            self.engine, self.decode, groups, self.sampling_params, self.reward_fn
        )

    def rollout(self) -> tuple[list[Group], dict[str, float]]:
        """The step's groups, with DAPO dynamic sampling when it is on."""
        if not self.cfg.rollout.dynamic_sampling:
            groups, metrics = self.draw_groups(), {}
        else:
            groups, metrics = fill_batch(
                self.draw_groups,
                self.cfg.rollout.prompts_per_step,
                max_rounds=self.cfg.rollout.max_sampling_rounds,
                device=self.device,
            )
        return groups, metrics

    def group_metrics(self, groups: list[Group]) -> dict[str, float]:
        """Rollout metrics of the groups a step trained on (and the agents', with agents)."""
        metrics = rollout_metrics(groups, self.device)
        if self.cfg.rollout.agent_function:
            metrics |= agent_metrics(groups, self.device)
        return metrics

    # --- multi-turn agents (rollout.agent_function) over the fleet's session server ------------

    def agent_kwargs(self) -> dict[str, Any]:
        rollout = self.cfg.rollout
        return agent_request_kwargs(
            model="policy",
            max_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            stop_token_ids=rollout.stop_token_ids,
        )

    def run_agents(self, groups: list[Group]) -> list[Group]:
        """Every sample played by the agent function on a session of its own, then scored.

        The agents run on an event loop of their own (kept for the run, so agents may keep
        connection pools on it), apart from the fleet's loop that serves the sessions, so an
        agent that blocks cannot stall the server."""
        if distributed.world_size() > 1:  # rank 0 plays every rank's samples
            here = self._run_agents_here if self.fleet is not None else None
            return on_rank_zero(groups, here)
        return self._run_agents_here(groups)

    def _run_agents_here(self, groups: list[Group]) -> list[Group]:
        fleet = self._require_fleet("rollout.agent_function")
        rollout = self.cfg.rollout
        assert rollout.agent_function is not None

        sessions_url = fleet.sessions_url()

        async def play() -> None:
            await run_agent_groups(
                sessions_url,
                groups,
                load_agent_fn(rollout.agent_function),
                self.agent_kwargs(),
                timeout_s=rollout.agent_timeout_s,
                max_concurrency=rollout.agent_max_concurrency,
                max_seq_len=rollout.agent_max_seq_len,
            )
            await score_agent_groups(groups, self.reward_fn)

        if self._agent_loop is None:
            self._agent_loop = LoopThread("verst-agents")
        self._agent_loop.run(play())
        return groups

    # --- fully asynchronous rollout (a fleet's loop runs the worker) ---------------------------

    async def generate_sample(self, sample: Sample) -> Sample:
        """One trajectory on the fleet; samples of one prompt share a routing key. With an
        agent function, the agent plays it on a session of its own (on the fleet's loop)."""
        assert self.fleet is not None
        rollout = self.cfg.rollout
        if rollout.agent_function:
            return await run_agent_sample(
                None,
                self._require_sessions_url(),
                sample,
                load_agent_fn(rollout.agent_function),
                self.agent_kwargs(),
                timeout_s=rollout.agent_timeout_s,
                max_seq_len=rollout.agent_max_seq_len,
            )
        request = GenerateRequest(
            input_ids=sample.prompt_tokens, sampling_params=copy.copy(self.sampling_params)
        )
        out = await self.fleet.agenerate(request, key=prompt_key(sample.prompt_tokens))
        fill_sample(sample, out, self.decode(out.output_ids))
        return sample

    def start_rollout_worker(self) -> RolloutWorker | None:
        """The worker on rank 0's fleet; None on the other ranks (rank 0 deals them groups)."""
        if distributed.rank() != 0:
            return None
        fleet = self._require_fleet("mode=fully_async")
        rollout = self.cfg.rollout
        if rollout.agent_function:  # started here: the worker's loop cannot wait on itself
            self._sessions_url = fleet.sessions_url()
        worker = build_rollout_worker(
            rollout,
            self.data,
            self.generate_sample,
            self.reward_fn,
            prompts_per_step=rollout.prompts_per_step,
            n_samples_per_prompt=rollout.n_samples_per_prompt,
            group_filter=has_reward_variance if rollout.dynamic_sampling else None,
        )
        fleet.loop.run(worker.start())
        self._worker = worker
        return worker

    def take_groups(self, worker: RolloutWorker | None, version: int) -> list[Group]:
        """This rank's share of one step's groups from the buffer (a collective under torchrun)."""
        groups = None
        if worker is not None:
            assert self.fleet is not None
            groups = self.fleet.loop.run(worker.take(self.cfg.rollout.prompts_per_step, version))
        world = distributed.world_size()
        if world == 1:
            assert groups is not None
            return groups
        return scatter_from_rank_zero(
            None if groups is None else [groups[r::world] for r in range(world)]
        )

    def worker_metrics(self, worker: RolloutWorker | None) -> dict[str, Any]:
        if worker is None:
            return {}
        assert self.fleet is not None
        return self.fleet.loop.call(worker.metrics)

    def stop_rollout_worker(self, worker: RolloutWorker | None) -> None:
        self._worker = None
        if worker is not None:
            assert self.fleet is not None
            self.fleet.loop.run(worker.stop())

    def _require_sessions_url(self) -> str:
        if self._sessions_url is None:
            raise RuntimeError("the session server was not started before the rollout worker")
        return self._sessions_url

    def _require_fleet(self, what: str) -> Fleet:
        if self.fleet is None:
            raise RuntimeError(f"{what} needs serving engines (placement.engines)")
        return self.fleet

    def _data_state(self) -> dict[str, Any]:
        # While a rollout worker runs, the data source belongs to the fleet's loop thread, and
        # the prompts the worker holds (generating, in the buffer) go into the saved state.
        worker = self._worker
        if self.fleet is not None and worker is not None:
            return self.fleet.loop.call(
                lambda: self.data.state_dict(pending=worker.unconsumed_prompts())
            )
        return self.data.state_dict()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_answer(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_ids[0]]

    def dev_accuracy(self) -> float:
        assert self.dev_evaluator is not None
        self.sync.push(self.engine.weight_version + 1)  # every weight change is a new version
        return self.dev_evaluator.run(self.engine)["eval/accuracy"]

    # --- reference model -------------------------------------------------------------------------

    def start_rl(self) -> None:
        """After any warm start: snapshot the policy as the KL reference (also on disk, for
        resume) and start the PPO critic from the policy's body."""
        if self.cfg.loss.needs_reference_model:
            weights = self.trainer.full_state_dict()
            if distributed.rank() == 0:
                self.shell.save_pretrained(self.run_dir / REFERENCE_DIR, state_dict=weights)
            distributed.barrier()
            self.trainer.set_reference(copy.deepcopy(self.shell))
        if self.cfg.loss.needs_critic:
            self.trainer.attach_critic(ValueModel(self.shell))

    # --- checkpoints ------------------------------------------------------------------------------

    def save(self, step: int, version: int, *, keep_existing: bool = False) -> Path:
        """Save the current state as checkpoint `step` (collective: every rank calls it)."""
        existing = [p for p in list_checkpoints(self.run_dir) if p.name == f"step_{step:06d}"]
        if keep_existing and existing:
            return existing[0]
        state = {
            "step": step,
            "weight_version": version,
            "trainer": self.trainer.optimizer_state(),
            "data": self._data_state(),
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
            }
            | self._engine_rng(),
        }
        return save_checkpoint(
            self.run_dir,
            step,
            weights=self.trainer.full_state_dict(),
            shell=self.shell,
            tokenizer=self.tokenizer,
            state=state,
            keep_last=self.cfg.checkpoint.keep_last,
        )

    def _engine_rng(self) -> dict[str, torch.Tensor]:
        # Serving engines sample with their own seeds, in their own processes.
        return (
            {"engine": self.engine.generator.get_state()} if isinstance(self.engine, Engine) else {}
        )

    def restore_latest(self) -> tuple[int, int]:
        """Load the newest complete checkpoint; returns (step, weight version)."""
        checkpoints = list_checkpoints(self.run_dir)
        if not checkpoints:
            raise FileNotFoundError(
                f"--resume: no checkpoint under {self.run_dir / 'checkpoints'} to resume from"
            )
        weights, state = load_checkpoint(checkpoints[-1])
        if self.cfg.loss.needs_critic:
            self.trainer.attach_critic(ValueModel(self.shell))  # weights come from the state
        self.trainer.load_state(weights, state["trainer"])
        self.data.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if isinstance(self.engine, Engine):
            self.engine.generator.set_state(state["rng"]["engine"])
        if self.cfg.loss.needs_reference_model:
            reference = copy.deepcopy(self.shell)
            reference.load_state_dict(load_weights(self.run_dir / REFERENCE_DIR))
            self.trainer.reference = reference.to(self.device, self.trainer.dtype).eval()
        _truncate_metrics(self.run_dir / "metrics.jsonl", state["step"])
        return state["step"], state["weight_version"]


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after the checkpoint we resume from, so each step appears once."""
    if distributed.rank() != 0 or not path.is_file():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(line + "\n" for line in kept))


def build(cfg: RunConfig, run_dir: Path) -> Run:
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    device = distributed.resolve_device(cfg.trainer.device)
    distributed.init_distributed(device)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    model, tokenizer = load_model_and_tokenizer(cfg.model, seed=cfg.seed, device=device)
    shell = copy.deepcopy(model)
    engine_dtype = compute_dtype(cfg.trainer.dtype, device)
    engine_model = copy.deepcopy(model).to(dtype=engine_dtype).eval()
    trainer = Trainer(
        model,
        cfg.trainer,
        cfg.loss,
        total_steps=cfg.num_steps,
        pad_token_id=tokenizer.pad_token_id,
        temperature=cfg.rollout.temperature,
        constant_normaliser=cfg.loss.constant_normaliser or float(cfg.rollout.max_new_tokens),
        device=device,
    )
    eos_ids = eos_token_ids(shell, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    fleet: Fleet | None = None
    engine: Engine | Fleet | RankedFleet
    sync: ColocatedSync | FleetSync
    if cfg.placement.serving:
        if distributed.rank() == 0:
            fleet = start_fleet(cfg, run_dir, engine_model, shell, tokenizer, device)
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
                engine_dtype=engine_dtype,
                run_dir=run_dir,
            )
        except BaseException:
            if fleet is not None:
                fleet.close()
            raise
    else:
        engine = Engine(
            engine_model,
            eos_token_ids=eos_ids,
            pad_token_id=pad_id,
            seed=cfg.seed + distributed.rank(),
        )
        sync = ColocatedSync(trainer, engine)
    reward_fn = load_reward_fn(cfg.rollout.reward)
    eval_reward_fn = load_reward_fn(cfg.eval.reward) if cfg.eval.reward else reward_fn

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def evaluator_for(data_cfg) -> Evaluator:
        prompts = DataSource(data_cfg, tokenizer, n_samples_per_prompt=1, seed=cfg.seed)
        return Evaluator(cfg.eval, prompts.prompts_in_order(), eval_reward_fn, decode, device)

    warm = cfg.warm_start
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        device=device,
        tokenizer=tokenizer,
        shell=shell,
        trainer=trainer,
        engine=engine,
        sync=sync,
        data=DataSource(
            cfg.data,
            tokenizer,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            seed=cfg.seed,
        ),
        sampling_params=cfg.rollout.sampling_params(),
        reward_fn=reward_fn,
        evaluator=evaluator_for(cfg.eval.data) if cfg.eval.interval_steps > 0 else None,
        warm_start_data=DataSource(warm.data, tokenizer, n_samples_per_prompt=1, seed=cfg.seed)
        if warm.enabled
        else None,
        dev_evaluator=evaluator_for(warm.dev_data) if warm.enabled else None,
        eos_ids=eos_ids,
        fleet=fleet,
    )


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
    )
