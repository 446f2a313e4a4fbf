"""Fully asynchronous diffusion rollout (`mode: fully_async`) on the LM's worker and data buffer.

The rollout worker (`verst.rollout.async_worker`), its data buffer, staleness bound, in-flight
limit and unused-group rules are the LM run's, unchanged: a diffusion trajectory travels as a
`Sample` whose `prompt` is the caption, whose metadata holds its noise seed, the steps it
trains (drawn per group when the group starts, as `diffusion.step_strategy` says) and, once
generated, its `Trajectory`; `weight_versions` holds the version that sampled it, so the
buffer computes staleness as for tokens.

`TrajectoryBatcher.generate_sample` is the worker's generate function: the samples waiting on
the worker's event loop are generated as one engine batch on a thread (the engine's own weights,
never the trainer's) and scored in the same call, one batch at a time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from verst.config import RunConfig
from verst.diffusion import shapes
from verst.diffusion.engine import DiffusionEngine
from verst.diffusion.requests import draw_captions, request, train_steps
from verst.diffusion.rewards import ImageReward
from verst.diffusion.server import DiffusionClient
from verst.fleet.loop_thread import LoopThread
from verst.rollout.async_worker import RolloutWorker
from verst.rollout.worker_build import build_rollout_worker
from verst.types import Group, Sample, Status

TRAJECTORY = "trajectory"
SEED = "seed"
TRAIN_STEPS = "train_steps"


class CaptionSource:
    """The worker's prompt source: each group is one caption's `n_samples_per_prompt` Samples,
    drawn under the seed and the group's draw number; captions given back are served first."""

    def __init__(self, cfg: RunConfig, state: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        state = state or {}
        self.drawn = int(state.get("drawn", 0))
        self.returned: list[str] = list(state.get("returned", []))

    def take(self, n_prompts: int) -> list[Group]:
        return [self._group() for _ in range(n_prompts)]

    def _group(self) -> Group:
        draw, self.drawn = self.drawn, self.drawn + 1
        caption = self.returned.pop(0) if self.returned else draw_captions(self.cfg, 1, draw)[0]
        n = self.cfg.rollout.n_samples_per_prompt
        chosen = train_steps(self.cfg, draw)
        base = (self.cfg.seed * 100_000 + draw) * n
        return [
            Sample(
                prompt=caption,
                prompt_id=shapes.CAPTIONS.index(caption),
                group_index=draw,
                index=k,
                metadata={SEED: base + k, TRAIN_STEPS: chosen},
            )
            for k in range(n)
        ]

    def give_back(self, groups: list[Group]) -> None:
        self.returned += [str(group[0].prompt) for group in groups]

    def state_dict(self, pending: list[Group] = ()) -> dict[str, Any]:
        """The draw count and the captions to serve first, with those of `pending` groups."""
        return {
            "drawn": self.drawn,
            "returned": [str(g[0].prompt) for g in pending] + self.returned,
        }


class TrajectoryBatcher:
    """Generates the samples that wait together as one engine batch, and scores them."""

    def __init__(
        self, cfg: RunConfig, engine: DiffusionEngine | DiffusionClient, reward: ImageReward
    ) -> None:
        self.cfg, self.engine, self.reward = cfg, engine, reward
        self.max_batch = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
        self._waiting: list[tuple[Sample, asyncio.Future]] = []
        self._drain: asyncio.Task | None = None

    async def generate_sample(self, sample: Sample) -> Sample:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((sample, future))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.ensure_future(self._run())
        return await future

    async def _run(self) -> None:
        while self._waiting:
            await asyncio.sleep(0)  # the rest of the groups just started join this batch
            batch = self._waiting[: self.max_batch]
            self._waiting = self._waiting[self.max_batch :]
            try:
                done = await asyncio.to_thread(self._generate, [s for s, _ in batch])
            except Exception as error:  # each sample is aborted with the cause
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), sample in zip(batch, done, strict=True):
                if not future.done():
                    future.set_result(sample)

    def _generate(self, samples: list[Sample]) -> list[Sample]:
        requests = [
            request(self.cfg, str(s.prompt), s.metadata[SEED], s.metadata[TRAIN_STEPS])
            for s in samples
        ]
        trajectories = self.engine.generate(requests)
        images = torch.stack([t.image for t in trajectories])
        rewards = self.reward(images, [r.prompt for r in requests])
        if len(rewards) != len(trajectories):
            raise ValueError(
                f"diffusion.reward returned {len(rewards)} scores for {len(trajectories)} images"
            )
        for sample, trajectory, value in zip(samples, trajectories, rewards, strict=True):
            trajectory.reward = float(value)
            sample.reward = float(value)
            sample.status = Status.COMPLETED
            sample.weight_versions = [trajectory.weight_version]
            sample.metadata[TRAJECTORY] = trajectory
        return samples

    async def close(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)


class AsyncDiffusionRollout:
    """The worker on an event loop of its own; each step takes one batch of finished groups."""

    def __init__(
        self,
        cfg: RunConfig,
        engine: DiffusionEngine | DiffusionClient,
        reward: ImageReward,
        source_state: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.source = CaptionSource(cfg, source_state)
        self.batcher = TrajectoryBatcher(cfg, engine, reward)
        self.loop = LoopThread("verst-diffusion-rollout")
        self.worker: RolloutWorker | None = None

    def start(self) -> None:
        r = self.cfg.rollout
        worker = build_rollout_worker(
            r,
            self.source,
            self.batcher.generate_sample,
            None,  # the batcher scores each batch itself
            prompts_per_step=r.prompts_per_step,
            n_samples_per_prompt=r.n_samples_per_prompt,
            # group advantages here take whole groups: one failed trajectory sets its group aside
            min_scored_samples=r.n_samples_per_prompt,
            max_prompt_retries=r.max_prompt_retries,
        )
        self.loop.run(worker.start())
        self.worker = worker

    def take(self, version: int) -> list[Group]:
        assert self.worker is not None, "start the rollout first"
        return self.loop.run(self.worker.take(self.cfg.rollout.prompts_per_step, version))

    def metrics(self) -> dict[str, float]:
        assert self.worker is not None
        return self.loop.call(self.worker.metrics)

    def source_state(self) -> dict[str, Any]:
        """The source's state with the captions of every group drawn and not yet trained."""
        worker = self.worker
        if worker is None:
            return self.source.state_dict()
        return self.loop.call(lambda: self.source.state_dict(pending=worker.unconsumed_prompts()))

    def close(self) -> None:
        worker, self.worker = self.worker, None
        try:
            if worker is not None:
                self.loop.run(worker.stop())
            self.loop.run(self.batcher.close())
        finally:
            self.loop.close()
