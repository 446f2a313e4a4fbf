"""Where a step's groups come from: one interface over the rollouts.

- `EngineRollout`: each step draws prompts and generates every sample in one engine call (the
  embedded scheduler, a fleet, or rank 0's fleet under torchrun), or each sample with the
  generate function (`rollout.generate_function`), their engine calls batched.
- `AgentRollout`: each step draws prompts and an agent function plays every sample on a session
  of its own (`rollout.agent_function`, or the environment of `env.name`), through the fleet's
  session server.
- `FunctionRollout`: each step is the rollout function's (`rollout.function`).
- `AsyncRollout` (`mode: fully_async`): a `RolloutWorker` on the fleet's loop generates without
  pause into the data buffer; each step takes one batch of finished groups from it.

Every source returns this rank's share of the step's groups. The loop scores them next (the
reward phase); a source scores groups itself only where it must filter on rewards first
(DAPO dynamic sampling, and the worker's filter before groups enter the buffer). Then the
source settles the step (`settle`): a group with fewer than `rollout.min_scored_samples`
samples neither ABORTED nor FAILED is not trained, and its prompt is given back to be served in
a later step (at most `rollout.max_prompt_retries` times, then dropped). Every group's fate
goes into the prompt ledger (`verst.rollout.ledger`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from verst import distributed
from verst.data.source import DataSource
from verst.engine import GenerateRequest
from verst.fleet.fleet import Fleet, prompt_key
from verst.fleet.loop_thread import LoopThread
from verst.fleet.ranked import on_rank_zero, scatter_from_rank_zero
from verst.plugins import (
    AgentFunction,
    Generator,
    RolloutContext,
    RolloutFunction,
    RolloutRequest,
    RolloutResult,
)
from verst.rollout.agent import (
    agent_metrics,
    agent_request_kwargs,
    close_agent,
    run_agent_groups,
    run_agent_sample,
)
from verst.rollout.async_worker import RolloutWorker
from verst.rollout.dynamic import fill_batch
from verst.rollout.generate import RolloutConfig, fill_sample, generate_groups
from verst.rollout.generate_fn import generate_groups_with, generate_one
from verst.rollout.ledger import (
    DROPPED,
    RETRIED,
    SURPLUS,
    TOO_FEW_SCORED,
    TRAINED,
    Fate,
    Ledger,
    filtered,
    unused_fate,
)
from verst.rollout.metrics import rollout_metrics
from verst.rollout.rewards import RewardScorer
from verst.rollout.worker_build import build_rollout_worker
from verst.types import Group, Sample, scored_count


class RolloutSource(Protocol):
    def start(self) -> None:
        """Begin generating ahead of the steps, where the source does (after any warm start and
        the first weight push)."""
        ...

    def groups(self, version: int) -> tuple[list[Group], dict[str, float]]:
        """This rank's groups for one step (a collective under torchrun), and metrics of how
        they were drawn; `version` is the weight version the engines hold."""
        ...

    def settle(self, groups: list[Group]) -> list[Group]:
        """The scored groups a step trains (a collective under torchrun); the prompts of the
        others go back to be served again, or are dropped; every fate goes into the ledger."""
        ...

    def metrics(self, groups: list[Group]) -> dict[str, Any]:
        """Rollout metrics of the groups a step trained on, and of the source itself."""
        ...

    def data_state(self) -> dict[str, Any]:
        """The data source's state for a checkpoint, with every prompt the source holds."""
        ...

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Hold generation still (for an evaluation on the same engines): none starts, the
        trajectories in flight finish first."""
        ...

    def close(self) -> None: ...


class _StepRollout(ABC):
    """The synchronous rollouts: draw this rank's prompts, generate, and with a filter
    (`rollout.filter`; dynamic sampling's keeps groups with reward variance) score and redraw
    until enough groups are kept.

    Under torchrun every rank's data source draws the same prompts and each rank keeps a slice,
    so every prompt given back must go back to every rank's source, in the same order: `settle`
    gathers the fates of all ranks' groups and applies them on each rank."""

    def __init__(
        self,
        cfg: RolloutConfig,
        data: DataSource,
        rewards: RewardScorer,
        device: torch.device,
        ledger: Ledger,
    ) -> None:
        self.cfg = cfg
        self.data = data
        self.rewards = rewards
        self.device = device
        self.ledger = ledger
        self.keep = cfg.load_filter()
        self._decided: list[Fate] = []  # this step's groups already set aside, until settled

    def start(self) -> None:  # noqa: B027 (a hook: a step rollout has nothing to start)
        """Nothing runs ahead: each step draws its own groups."""

    @abstractmethod
    def draw(self) -> list[Group]:
        """This rank's share of one step's prompts, generated (`EngineRollout`) or played by
        agents (`AgentRollout`)."""

    def prompts(self) -> list[Group]:
        """This rank's share of one step's prompts."""
        rank_slice = slice(distributed.rank(), None, distributed.world_size())
        return self.data.take(self.cfg.prompts_per_step)[rank_slice]

    def groups(self, version: int) -> tuple[list[Group], dict[str, float]]:
        if self.keep is None:
            return self.draw(), {}

        def scored() -> list[Group]:
            groups = self.draw()
            self.rewards.score_groups(groups)
            return self._enough_scored(groups)

        filled = fill_batch(
            scored,
            self.cfg.prompts_per_step,
            max_rounds=self.cfg.max_sampling_rounds,
            device=self.device,
            keep=self.keep,
        )
        self._decided += [Fate.of(group, RETRIED, SURPLUS) for group in filled.surplus]
        self._decided += [Fate.of(g, DROPPED, filtered(why)) for g, why in filled.rejected]
        return filled.groups, filled.metrics

    def settle(self, groups: list[Group]) -> list[Group]:
        trained = self._enough_scored(groups)
        fates, self._decided = self._decided + [Fate.of(g, TRAINED) for g in trained], []
        for rank_fates in distributed.all_gather_object(fates):
            for fate in rank_fates:
                if fate.outcome == RETRIED:
                    assert fate.prompt_id is not None, "a data source's prompt has an id"
                    self.data.give_back_prompt(
                        fate.prompt_id, epoch=fate.epoch, retries=fate.retries
                    )
            self.ledger.record(rank_fates)
        return trained

    def _enough_scored(self, groups: list[Group]) -> list[Group]:
        """The groups with `min_scored_samples` scored samples; the others are set aside."""
        kept = []
        for group in groups:
            if scored_count(group) >= self.cfg.min_scored_samples:
                kept.append(group)
            else:
                self._decided.append(
                    unused_fate(
                        group, TOO_FEW_SCORED, retry=True, max_retries=self.cfg.max_prompt_retries
                    )
                )
        return kept

    def metrics(self, groups: list[Group]) -> dict[str, Any]:
        counts = {"rollout/reward_errors": float(self.rewards.take_failed())}
        return rollout_metrics(groups, self.device, counts | self.ledger.take_counts())

    def data_state(self) -> dict[str, Any]:
        return self.data.state_dict()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Nothing generates between steps."""
        return contextlib.nullcontext()

    def close(self) -> None:  # noqa: B027 (a hook: only AgentRollout holds a loop)
        """Nothing to stop unless a subclass holds a loop."""


class EngineRollout(_StepRollout):
    def __init__(
        self,
        cfg: RolloutConfig,
        data: DataSource,
        rewards: RewardScorer,
        device: torch.device,
        ledger: Ledger,
        *,
        engine: Generator,
        decode: Callable[[list[int]], str],
    ) -> None:
        super().__init__(cfg, data, rewards, device, ledger)
        self.engine = engine
        self.decode = decode
        self.sampling_params = cfg.sampling_params()
        self.generate_fn = cfg.load_generate_function()

    def draw(self) -> list[Group]:
        return self.generate(self.prompts())

    def generate(self, groups: list[Group]) -> list[Group]:
        """`groups` generated in place: in one engine call, or each sample by the generate
        function (`rollout.generate_function`)."""
        if self.generate_fn is not None:
            fn = self.generate_fn
            return generate_groups_with(fn, self.engine, self.decode, groups, self.sampling_params)
        return generate_groups(
            self.engine,
            self.decode,
            groups,
            self.sampling_params,
            routed_experts=self.cfg.return_routed_experts,
        )


class FunctionRollout(EngineRollout):
    """Each step is the rollout function's (`rollout.function`): it draws, generates, scores
    and filters through a `RolloutContext`; the groups it drops are recorded like a filter's
    (`filter: <reason>`), and the rest is settled as any step's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        fn = self.cfg.load_function()
        assert fn is not None, "FunctionRollout needs rollout.function"
        self.fn = fn
        rank_slice = slice(distributed.rank(), None, distributed.world_size())
        self.context = RolloutContext(
            prompts_per_step=self.cfg.prompts_per_step,
            n_samples_per_prompt=self.cfg.n_samples_per_prompt,
            take=lambda n: self.data.take(n)[rank_slice],
            generate=self.generate,
            score=self.rewards.score_groups,
            keep=self.keep,
            engine=self.engine,
            decode=self.decode,
            params=self.sampling_params,
        )

    def groups(self, version: int) -> tuple[list[Group], dict[str, float]]:
        result = self.call(RolloutRequest(step=self.ledger.step, weight_version=version))
        self._decided += [Fate.of(g, DROPPED, filtered(why)) for g, why in result.dropped]
        return result.groups, dict(result.metrics)

    def call(self, request: RolloutRequest) -> RolloutResult:
        return call_rollout_function(self.fn, str(self.cfg.function), self.context, request)


def call_rollout_function(
    fn: RolloutFunction, path: str, context: RolloutContext, request: RolloutRequest
) -> RolloutResult:
    """`fn`'s result for `request` (awaited when it is `async def`), checked."""
    result = fn(context, request)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    if not isinstance(result, RolloutResult) or not all(
        isinstance(g, list) and all(isinstance(x, Sample) for x in g) for g in result.groups
    ):
        raise TypeError(
            f"rollout.function {path!r} returned {type(result).__name__}, not a "
            "verst.plugins.RolloutResult whose groups are lists of Samples"
        )
    return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def agent_kwargs(cfg: RolloutConfig) -> dict[str, Any]:
    """The OpenAI request options every agent call starts from."""
    return agent_request_kwargs(
        model="policy",
        max_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        stop_token_ids=cfg.stop_token_ids,
    )


class AgentRollout(_StepRollout):
    """Every sample played by the agent function on a session of its own. The agents run on
    an event loop of their own (kept for the run, so agents may keep connection pools on it),
    apart from the fleet's loop that serves the sessions, so an agent that blocks cannot stall
    the server. Under torchrun rank 0 plays every rank's samples."""

    def __init__(
        self,
        cfg: RolloutConfig,
        data: DataSource,
        rewards: RewardScorer,
        device: torch.device,
        ledger: Ledger,
        *,
        fleet: Fleet | None,
        agent_fn: AgentFunction,
    ) -> None:
        super().__init__(cfg, data, rewards, device, ledger)
        self.fleet = fleet
        self.agent_fn = agent_fn
        self._loop: LoopThread | None = None

    def draw(self) -> list[Group]:
        groups = self.prompts()
        if distributed.world_size() > 1:
            return on_rank_zero(groups, self._play if self.fleet is not None else None)
        return self._play(groups)

    def _play(self, groups: list[Group]) -> list[Group]:
        assert self.fleet is not None
        sessions_url = self.fleet.sessions_url()
        play = run_agent_groups(
            sessions_url,
            groups,
            self.agent_fn,
            agent_kwargs(self.cfg),
            timeout_s=self.cfg.agent_timeout_s,
            max_concurrency=self.cfg.agent_max_concurrency,
            max_seq_len=self.cfg.agent_max_seq_len,
        )
        if self._loop is None:
            self._loop = LoopThread("verst-agents")
        return self.fleet.wait(play, on=self._loop)

    def metrics(self, groups: list[Group]) -> dict[str, Any]:
        return super().metrics(groups) | agent_metrics(groups, self.device)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
        close_agent(self.agent_fn)


class AsyncRollout:
    """The fully asynchronous rollout: rank 0's fleet runs the worker, which generates (plain
    or with the agent function), scores and buffers groups without pause; each step takes one
    batch from the buffer and deals every rank its share.

    The worker has a reward scorer of its own (with the same function and timeout), on the
    fleet's event loop; it sets aside groups with too few scored samples, and the buffer drops
    aborted, filtered and stale ones, recording each fate in the ledger from that loop's thread;
    the groups a step takes are recorded as trained by rank 0, before they are dealt."""

    def __init__(
        self,
        cfg: RolloutConfig,
        data: DataSource,
        rewards: RewardScorer,
        device: torch.device,
        ledger: Ledger,
        *,
        fleet: Fleet | None,
        decode: Callable[[list[int]], str],
        agent_fn: AgentFunction | None = None,
    ) -> None:
        self.cfg = cfg
        self.agent_fn = agent_fn
        self.data = data
        self.device = device
        self.ledger = ledger
        self.fleet = fleet
        self.decode = decode
        self.sampling_params = cfg.sampling_params()
        self.generate_fn = cfg.load_generate_function()
        self._sessions_url: str | None = None
        self.rewards = rewards
        self.worker: RolloutWorker | None = None

    def start(self) -> None:
        if self.fleet is None:  # a rank other than 0: it is dealt its groups
            return
        cfg = self.cfg
        if self.agent_fn is not None:  # started here: the worker's loop cannot wait on itself
            self._sessions_url = self.fleet.sessions_url()
        worker = build_rollout_worker(
            cfg,
            self.data,
            self.generate_sample,
            self.rewards.fn,
            prompts_per_step=cfg.prompts_per_step,
            n_samples_per_prompt=cfg.n_samples_per_prompt,
            group_filter=cfg.load_filter(),
            group_reward_fn=self.rewards.group_fn,
            ledger=self.ledger,
            reward_timeout_s=self.rewards.timeout_s,
            min_scored_samples=cfg.min_scored_samples,
            max_prompt_retries=cfg.max_prompt_retries,
        )
        self.fleet.loop.run(worker.start())
        self.worker = worker

    async def generate_sample(self, sample: Sample) -> Sample:
        """One trajectory on the fleet; samples of one prompt share a routing key. With an
        agent function, the agent plays it on a session of its own (on the fleet's loop); with
        a generate function, that function generates it."""
        assert self.fleet is not None
        if self.generate_fn is not None:
            return await generate_one(
                self.generate_fn, self.fleet, sample, self.sampling_params, self.decode
            )
        if self.agent_fn is not None:
            assert self._sessions_url is not None
            return await run_agent_sample(
                None,
                self._sessions_url,
                sample,
                self.agent_fn,
                agent_kwargs(self.cfg),
                timeout_s=self.cfg.agent_timeout_s,
                max_seq_len=self.cfg.agent_max_seq_len,
            )
        request = GenerateRequest(
            input_ids=sample.prompt_tokens,
            sampling_params=copy.copy(self.sampling_params),
            lora_path=sample.adapter,
            return_routed_experts=self.cfg.return_routed_experts,
        )
        out = await self.fleet.agenerate(request, key=prompt_key(sample.prompt_tokens))
        routed = self.cfg.return_routed_experts
        fill_sample(sample, out, self.decode(out.output_ids), routed_experts=routed)
        return sample

    def groups(self, version: int) -> tuple[list[Group], dict[str, float]]:
        groups = None
        if self.worker is not None:
            assert self.fleet is not None
            take = self.worker.take(self.cfg.prompts_per_step, version)
            groups = self.fleet.wait(take)
            self.ledger.record(Fate.of(group, TRAINED) for group in groups)
        world = distributed.world_size()
        if world == 1:
            assert groups is not None
            return groups, {}
        per_rank = None if groups is None else [groups[r::world] for r in range(world)]
        return scatter_from_rank_zero(per_rank), {}

    def settle(self, groups: list[Group]) -> list[Group]:
        """Every group taken is trained: the worker and the buffer kept back the others."""
        return groups

    def metrics(self, groups: list[Group]) -> dict[str, Any]:
        metrics = rollout_metrics(groups, self.device)
        if self.agent_fn is not None:
            metrics |= agent_metrics(groups, self.device)
        if self.worker is not None:
            assert self.fleet is not None
            metrics |= self.fleet.loop.call(self.worker.metrics) | self.ledger.take_counts()
        return metrics

    def data_state(self) -> dict[str, Any]:
        """While the worker runs, the data source belongs to the fleet's loop thread, and the
        prompts the worker holds (generating, in the buffer) go into the saved state."""
        worker = self.worker
        if worker is None or self.fleet is None:
            return self.data.state_dict()
        return self.fleet.loop.call(
            lambda: self.data.state_dict(pending=worker.unconsumed_prompts())
        )

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        worker = self.worker
        if worker is None or self.fleet is None:
            yield
            return
        self.fleet.wait(worker.pause())
        try:
            yield
        finally:
            self.fleet.wait(worker.resume())

    def close(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None and self.fleet is not None:
            self.fleet.loop.run(worker.stop())
        close_agent(self.agent_fn)
