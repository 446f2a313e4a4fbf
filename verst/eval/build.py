"""Builds the evaluators of a run's evaluation sets (`eval.sets`, or the default set)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from verst import distributed
from verst.data.source import DataSource, DataSourceConfig
from verst.engine import SamplingParams
from verst.eval.config import EvalConfig, EvalSetConfig
from verst.eval.evaluate import Evaluator, SetEvaluators
from verst.eval.external import ExternalScorer
from verst.eval.fleet_eval import FleetScorer, start_eval_fleet
from verst.eval.points import EvalPoints, snapshot_exporter
from verst.eval.rollout_fn import RolloutFunctionEval
from verst.plugins import Generator, RewardFunction
from verst.rollout.rewards import RewardScorer, load_reward_fn


def set_evaluator(
    spec: EvalSetConfig,
    rollout_reward_fn: RewardFunction,
    tokenizer: PreTrainedTokenizerBase,
    decode: Callable[[list[int]], str],
    device: torch.device,
    *,
    seed: int,
    reward_timeout_s: float | None,
    prefix: str,
    rows: list | None = None,
    sharded: bool = True,
    rollout_function: str | None = None,
) -> Evaluator:
    """One set's evaluator, scored by its reward (else the rollout's); generated and scored by
    `rollout_function` (`rollout.function`) when one is named."""
    field = f"eval.sets[{spec.name}].reward" if spec.name else "eval.reward"
    if spec.reward:
        fn = load_reward_fn(spec.reward, field=field)
    else:
        fn, field = rollout_reward_fn, "rollout.reward (in eval)"
    prompts = DataSource(spec.data, tokenizer, n_samples_per_prompt=1, seed=seed, rows=rows)
    scorer = RewardScorer(fn, timeout_s=reward_timeout_s, field=field)
    params = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature)
    return Evaluator(
        params,
        spec.n_samples,
        prompts.prompts_in_order(),
        scorer,
        decode,
        device,
        prefix,
        sharded=sharded,
        generate=RolloutFunctionEval(rollout_function) if rollout_function else None,
    )


def build_evaluators(
    cfg: EvalConfig,
    rollout_reward_fn: RewardFunction,
    tokenizer: PreTrainedTokenizerBase,
    decode: Callable[[list[int]], str],
    device: torch.device,
    *,
    seed: int,
    reward_timeout_s: float | None,
    sharded: bool = True,
    rollout_function: str | None = None,
) -> Evaluator | SetEvaluators:
    """The default set's evaluator (`eval/*`), or one per named set (`eval/<name>/*`)."""

    def build(spec: EvalSetConfig) -> Evaluator:
        prefix = f"eval/{spec.name}" if spec.name else "eval"
        return set_evaluator(
            spec,
            rollout_reward_fn,
            tokenizer,
            decode,
            device,
            seed=seed,
            reward_timeout_s=reward_timeout_s,
            prefix=prefix,
            sharded=sharded,
            rollout_function=rollout_function,
        )

    specs = cfg.eval_sets()
    if len(specs) == 1 and not specs[0].name:
        return build(specs[0])
    return SetEvaluators({spec.name: build(spec) for spec in specs})


def default_set(cfg: EvalConfig, data: DataSourceConfig) -> EvalSetConfig:
    """The default set's options on other prompts (the warm start's dev set, an adapter's)."""
    return cfg.default_set(data, n_samples=1)


def build_eval_points(
    cfg: Any,
    run_dir: Path,
    *,
    policy: Any,
    tokenizer: PreTrainedTokenizerBase,
    decode: Callable[[list[int]], str],
    device: torch.device,
    engine_dtype: torch.dtype,
    rollout_reward_fn: RewardFunction,
    engine: Generator,
    paused: Callable[[], AbstractContextManager[None]],
    checkpoint_due: Callable[[int, bool], bool],
    shared: Evaluator | SetEvaluators | None,
) -> EvalPoints:
    """The run's `EvalPoints` for `cfg.eval.mode`: `shared` scores on `engine` with `shared`
    (multi-LoRA's adapter evaluators) or the evaluation sets; the snapshot modes start their
    scorer here (mode `fleet`: its engine processes)."""
    ev: EvalConfig = cfg.eval
    points = dict(run_dir=run_dir, engine=engine, paused=paused, checkpoint_due=checkpoint_due)
    if ev.interval_steps == 0:
        return EvalPoints(ev, evaluator=None, **points)
    sets = dict(
        seed=cfg.seed,
        reward_timeout_s=cfg.rollout.reward_timeout_s,
        rollout_function=cfg.rollout.function,
    )
    if not ev.snapshot:
        if shared is None:
            shared = build_evaluators(ev, rollout_reward_fn, tokenizer, decode, device, **sets)
        return EvalPoints(ev, evaluator=shared, **points)
    if distributed.world_size() > 1:
        raise ValueError(
            f"eval.mode={ev.mode} runs with one trainer process for now (not torchrun)"
        )
    export = snapshot_exporter(policy, tokenizer)
    if ev.mode == "external":
        assert ev.function is not None
        sets = [s.model_dump(mode="json") for s in ev.eval_sets()]
        scorer = ExternalScorer(ev.function, sets, nice=ev.nice)
        return EvalPoints(
            ev, evaluator=None, export=export, scorer=scorer, close_scorer=scorer.close, **points
        )
    evaluator = build_evaluators(
        ev, rollout_reward_fn, tokenizer, decode, device, **sets, sharded=False
    )
    first = (
        evaluator if isinstance(evaluator, Evaluator) else next(iter(evaluator.evaluators.values()))
    )
    fleet = start_eval_fleet(cfg, run_dir, policy.shell, tokenizer, device, engine_dtype)
    fleet_scorer = FleetScorer(
        fleet, evaluator, first.prompts[0].prompt_tokens, pin_timeout_s=ev.pin_timeout_s
    )
    return EvalPoints(
        ev,
        evaluator=None,
        export=export,
        scorer=fleet_scorer,
        close_scorer=fleet_scorer.close,
        **points,
    )
