"""The fully asynchronous rollout worker: keeps trajectories generating while the trainer trains.

`RolloutWorker` keeps up to `max_inflight` trajectories (samples) generating. It draws prompts
from the DataSource one group at a time, runs the injected `generate_sample` coroutine on each
sample of the group concurrently, scores the finished group with the reward function, and puts
it into the data buffer (`verst.rollout.buffer`). When the buffer is full the put blocks, and
while a put is blocked no new group starts, so generation drains instead of racing ahead of the
trainer: the buffer's bound is what bounds staleness.

When may a new group start? Each started group takes `n_samples_per_prompt` places out of
`max_inflight`; the replacement rule says when they are given up:

- `sample` (default): each finished trajectory frees its place at once, and a new group starts
  as soon as `n_samples_per_prompt` places are free, so a long-tailed trajectory holds one
  place, not its group's; the group's last place is held while the group is scored;
- `group`: a group's places are freed only when the whole group has finished (generated and
  scored).

Either way a group gives up its last places only as it goes into the buffer, and no group
starts while a put is blocked, so the trajectories generating stay within `max_inflight`, and
once the buffer is full, generation stops: the groups then in flight finish and wait at put.

Failures: an exception raised by `generate_sample` marks that sample ABORTED (with the reason in
`metadata["abort_error"]`), so the buffer drops its group at put; `max_consecutive_errors`
failures in a row (every generation failing, say the router is down) stop the worker instead of
spinning. An error in the worker itself (the data source, the buffer) stops it too, and
`take` raises `RolloutWorkerError` with the cause, so it never dies silently.

`stop()` cancels everything in flight; groups not yet accepted by the buffer are aborted, and
their prompts go to `give_back` (the DataSource's, with `unused: retry`) or are dropped.

Staleness control: a group is not started while `max_ahead` groups are already drawn and not
yet served (generating, at put, or in the buffer): with that many batches ahead of it, it could
only be served stale and dropped. `build_rollout_worker` sets it to `max_staleness` batches
(at least one), the rule AReaL uses to keep asynchronous generation from running ahead of the
trainer.

Checkpoints: `unconsumed_prompts()` lists the prompts the worker has drawn that no take has
served yet (generating, or waiting in the buffer), so a checkpoint can hand them back to the
DataSource in its saved state and a resumed run serves them again instead of losing them. The
buffer reports the groups it drops through `forget` (`build_rollout_worker` wires its
`give_back` and filter to it).

`verst train` runs the worker on the fleet's event loop (`verst.fleet.fleet.LoopThread`) and
reaches it from the synchronous trainer through that loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import Field, field_validator

from verst.configbase import ConfigBase
from verst.rollout.buffer import (
    DEFAULT_BUFFER,
    Buffer,
    GiveBack,
    GroupFilter,
    is_aborted,
    load_buffer_class,
    make_buffer,
)
from verst.rollout.rewards import RewardFn, compute_rewards
from verst.types import Group, Sample, Status

log = logging.getLogger(__name__)

Replacement = Literal["group", "sample"]
GenerateSample = Callable[[Sample], Awaitable[Sample]]


class AsyncConfig(ConfigBase):
    """Fully asynchronous rollout: the worker's in-flight limit and the data buffer."""

    max_inflight: int | None = Field(
        None,
        ge=1,
        description="most trajectories generating at once; null = one step's worth "
        "(prompts_per_step × n_samples_per_prompt)",
    )
    replacement: Replacement = Field(
        "sample",
        description="when a new group starts: 'sample' = once enough finished trajectories have "
        "freed their places, 'group' = only when a whole group has finished",
    )
    buffer_factor: float = Field(
        2.0,
        ge=1.0,
        description="data buffer capacity in train batches: ceil(factor × prompts_per_step) groups",
    )
    max_staleness: int | None = Field(
        4,
        ge=0,
        description="drop a group at take when current version − its oldest token's version "
        "exceeds this, and start none while this many batches wait untrained; null = never",
    )
    unused: Literal["drop", "retry"] = Field(
        "retry",
        description="aborted and stale groups: discard them, or return their prompts to the "
        "data source to be served again",
    )
    buffer: str = Field(
        DEFAULT_BUFFER, description="data buffer class by import path, e.g. pkg.mod:MyBuffer"
    )

    @field_validator("buffer")
    @classmethod
    def _buffer_importable(cls, value: str) -> str:
        load_buffer_class(value)
        return value

    def buffer_capacity(self, prompts_per_step: int) -> int:
        """The buffer's capacity in groups for a train batch of `prompts_per_step` groups."""
        return max(prompts_per_step, math.ceil(self.buffer_factor * prompts_per_step - 1e-9))

    def ahead_limit(self, prompts_per_step: int) -> int | None:
        """Most groups drawn and not yet served (generating or buffered): a group with
        `max_staleness` batches ahead of it would be stale by the time a take reaches it, so
        it is not started (its generation would be thrown away)."""
        if self.max_staleness is None:
            return None
        return max(self.max_staleness, 1) * prompts_per_step

    def inflight_limit(self, prompts_per_step: int, n_samples_per_prompt: int) -> int:
        """`max_inflight`, or one step's worth of trajectories when it is unset."""
        if self.max_inflight is not None:
            return self.max_inflight
        return prompts_per_step * n_samples_per_prompt


class PromptSource(Protocol):
    """What the worker needs from the DataSource."""

    def take(self, n_prompts: int) -> list[Group]: ...


class RolloutWorkerError(RuntimeError):
    """The rollout worker stopped because of an error; `__cause__` is that error."""


@dataclass
class _Flight:
    """A group from its start until the buffer accepts it."""

    group: Group
    prompts: Group  # untouched copies of the prompt side, to give back or stand in for aborts
    task: asyncio.Task | None = None
    generating: int = 0  # its samples inside generate_sample
    holds_last_place: bool = False  # generated, being scored (counted in _scoring)


class RolloutWorker:
    """Keeps up to `max_inflight` trajectories generating and feeds finished groups to `buffer`.

    - `source`: `take(1)` returns one group of `n_samples_per_prompt` fresh Samples;
    - `generate_sample(sample) -> sample`: generates one trajectory (in place or a new Sample),
      recording `weight_versions`; an exception aborts that sample;
    - `reward_fn`: a reward function (see `verst.rollout.rewards`) applied to each sample of a
      finished group that has no aborted sample; None when `generate_sample` sets rewards itself;
    - `give_back`: where the prompts of groups aborted by `stop()` go; None drops them.

    Run it inside an event loop: `await start()`, then `await take(n, version)` per step,
    `metrics()` any time, `await stop()` at the end (or `async with worker:`).
    """

    def __init__(
        self,
        source: PromptSource,
        buffer: Buffer,
        generate_sample: GenerateSample,
        reward_fn: RewardFn | None,
        *,
        n_samples_per_prompt: int,
        max_inflight: int,
        replacement: Replacement = "sample",
        give_back: GiveBack | None = None,
        max_consecutive_errors: int | None = None,
        max_ahead: int | None = None,
    ) -> None:
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        if max_inflight < n_samples_per_prompt:
            raise ValueError(
                f"max_inflight ({max_inflight}) must be at least n_samples_per_prompt "
                f"({n_samples_per_prompt}): a group needs that many places to start"
            )
        if replacement not in ("group", "sample"):
            raise ValueError(f"replacement must be 'group' or 'sample', got {replacement!r}")
        self.source = source
        self.buffer = buffer
        self.generate_sample = generate_sample
        self.reward_fn = reward_fn
        self.n_samples_per_prompt = n_samples_per_prompt
        self.max_inflight = max_inflight
        self.replacement = replacement
        self.give_back = give_back
        self.max_consecutive_errors = max_consecutive_errors or 2 * max_inflight
        if max_ahead is not None and max_ahead < 1:
            raise ValueError(f"max_ahead must be >= 1 group, got {max_ahead}")
        self.max_ahead = max_ahead
        # counters (cumulative)
        self.groups_started = 0
        self.groups_put = 0
        self.generate_errors = 0
        self.aborted_on_stop = 0
        # state
        self._flights: dict[int, _Flight] = {}
        # groups handed to the buffer, by id, with their prompts, until a take serves them or
        # the buffer drops them (`forget`)
        self._in_buffer: dict[int, Group] = {}
        self._next_id = 0
        self._generating = 0  # samples inside generate_sample now
        self._holding_groups = 0  # groups started and not yet handed to the buffer
        self._scoring = 0  # groups generated, being scored: each holds one place
        self._putting = 0  # groups inside buffer.put now (blocked when the buffer is full)
        self._consecutive_errors = 0
        self._failure: BaseException | None = None
        self._surfaced = False
        self._main: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._stopped = False
        # time-weighted in-flight count since the last metrics()
        self._area = 0.0
        self._since = self._mark = time.monotonic()
        self._peak = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start generating in the running event loop."""
        if self._main is not None:
            raise RuntimeError("the rollout worker was already started")
        self._wake = asyncio.Event()
        self._since = self._mark = time.monotonic()
        self._main = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Cancel everything in flight, give back (or drop) unfinished groups' prompts.

        Idempotent. Raises `RolloutWorkerError` if the worker had failed and no `take` has
        reported it yet.
        """
        if self._main is None or self._stopped:
            return
        self._stopped = True
        tasks = [self._main, *(f.task for f in self._flights.values() if f.task is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        unfinished = list(self._flights.values())
        self._flights.clear()
        for flight in unfinished:
            for sample in flight.group:
                if sample.status == Status.PENDING:
                    sample.status = Status.ABORTED
        self.aborted_on_stop += len(unfinished)
        if unfinished and self.give_back is not None:
            self.give_back([flight.prompts for flight in unfinished])
        if self._failure is not None and not self._surfaced:
            self._surfaced = True
            raise RolloutWorkerError(f"the rollout worker failed: {self._failure!r}") from (
                self._failure
            )

    async def __aenter__(self) -> RolloutWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the trainer's side --------------------------------------------------------------------

    async def take(self, n_groups: int, current_version: int) -> list[Group]:
        """`buffer.take`, but raising `RolloutWorkerError` if the worker dies meanwhile."""
        if self._main is None or self._stopped:
            raise RuntimeError("the rollout worker is not running (start it first)")
        if self._main.done():
            self._raise_dead()
        taking = asyncio.ensure_future(self.buffer.take(n_groups, current_version))
        try:
            await asyncio.wait({taking, self._main}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not taking.done():
                taking.cancel()
        if taking.done() and not taking.cancelled():
            served = taking.result()
            self.forget(served)
            return served
        self._raise_dead()

    def forget(self, groups: list[Group]) -> None:
        """These groups left the buffer (served, or dropped by its rules): not unconsumed."""
        for group in groups:
            self._in_buffer.pop(id(group), None)
        self._poke()  # fewer groups ahead: one may start

    def unconsumed_prompts(self) -> list[Group]:
        """The prompt side of every group drawn from the source and not yet served by a take
        nor dropped: generating, blocked at put, or waiting in the buffer."""
        flights = self._flights.values()
        generating = [f.prompts for f in flights if id(f.group) not in self._in_buffer]
        return generating + list(self._in_buffer.values())

    def metrics(self) -> dict[str, Any]:
        """The buffer's metrics and `rollout/*`: `inflight` (trajectories generating now),
        `inflight_mean` and `inflight_peak` (time-weighted mean and peak since the previous
        call), `inflight_groups` (started, not yet in the buffer), `max_inflight`, `put_blocked`
        (1 when a finished group waits for room), and cumulative `groups_started`,
        `groups_put`, `generate_errors`."""
        now = time.monotonic()
        self._account(now)
        elapsed = now - self._since
        mean = self._area / elapsed if elapsed > 0 else float(self._generating)
        peak = self._peak
        self._area, self._since, self._peak = 0.0, now, self._generating
        return self.buffer.metrics() | {
            "rollout/inflight": float(self._generating),
            "rollout/inflight_mean": mean,
            "rollout/inflight_peak": float(peak),
            "rollout/inflight_groups": float(len(self._flights)),
            "rollout/max_inflight": float(self.max_inflight),
            "rollout/put_blocked": float(self._putting > 0),
            "rollout/groups_started": float(self.groups_started),
            "rollout/groups_put": float(self.groups_put),
            "rollout/generate_errors": float(self.generate_errors),
        }

    @property
    def inflight(self) -> int:
        """Trajectories inside `generate_sample` now."""
        return self._generating

    @property
    def occupied(self) -> int:
        """Places held under the replacement rule (at most `max_inflight`)."""
        if self.replacement == "sample":
            return self._generating + self._scoring
        return self._holding_groups * self.n_samples_per_prompt

    # -- the worker ----------------------------------------------------------------------------

    def _can_start(self) -> bool:
        free = self.max_inflight - self.occupied
        if self.max_ahead is not None and len(self.unconsumed_prompts()) >= self.max_ahead:
            return False  # a group started now would be stale before a take could serve it
        return free >= self.n_samples_per_prompt and self._putting == 0

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if self._failure is not None:
                raise self._failure
            if self._can_start():
                self._launch()
                continue
            self._wake.clear()
            await self._wake.wait()

    def _launch(self) -> None:
        groups = self.source.take(1)
        if len(groups) != 1 or len(groups[0]) != self.n_samples_per_prompt:
            sizes = [len(g) for g in groups]
            raise RuntimeError(
                f"source.take(1) returned groups of sizes {sizes}, "
                f"expected one group of {self.n_samples_per_prompt}"
            )
        group = groups[0]
        flight = _Flight(group=group, prompts=[s.clone_prompt(s.index) for s in group])
        gid = self._next_id
        self._next_id += 1
        self._flights[gid] = flight
        self.groups_started += 1
        self._holding_groups += 1
        self._account()
        self._generating += len(group)
        flight.generating = len(group)
        self._peak = max(self._peak, self._generating)
        flight.task = asyncio.ensure_future(self._fly(gid, flight))
        flight.task.add_done_callback(self._on_flight_done)

    async def _fly(self, gid: int, flight: _Flight) -> None:
        holding = True  # the group holds places until it goes to the buffer
        try:
            results = await asyncio.gather(
                *(
                    self._generate(flight, sample, prompt)
                    for sample, prompt in zip(flight.group, flight.prompts, strict=True)
                )
            )
            flight.group = list(results)
            if self.reward_fn is not None and not is_aborted(flight.group):
                await compute_rewards(flight.group, self.reward_fn)
            # From here to the put's first suspension nothing awaits: the scheduler sees the
            # places freed and the put blocked (or done) in the same instant, never a gap in
            # which a new group could slip past a full buffer.
            self._release_last_place(flight)
            self._holding_groups -= 1
            holding = False
            self._putting += 1
            self._in_buffer[id(flight.group)] = flight.prompts  # a drop at put forgets it
            try:
                await self.buffer.put(flight.group)
            finally:
                self._putting -= 1
            # accepted (or dropped by the buffer's rules): no longer ours to give back
            del self._flights[gid]
            self.groups_put += 1
        finally:
            self._release_last_place(flight)
            if holding:
                self._holding_groups -= 1
            self._poke()

    def _release_last_place(self, flight: _Flight) -> None:
        if flight.holds_last_place:
            flight.holds_last_place = False
            self._scoring -= 1

    async def _generate(self, flight: _Flight, sample: Sample, prompt: Sample) -> Sample:
        try:
            result = await self.generate_sample(sample)
            if not isinstance(result, Sample):
                raise TypeError(f"generate_sample returned a {type(result).__name__}, not a Sample")
            self._consecutive_errors = 0
            return result
        except Exception as exc:
            self.generate_errors += 1
            self._consecutive_errors += 1
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("generation failed, sample aborted: %s", reason)
            if self._consecutive_errors >= self.max_consecutive_errors:
                error = RolloutWorkerError(
                    f"{self._consecutive_errors} generations failed in a row; last: {reason}"
                )
                error.__cause__ = exc
                self._fail(error)
            aborted = prompt.clone_prompt(prompt.index)
            aborted.status = Status.ABORTED
            aborted.metadata["abort_error"] = reason
            return aborted
        finally:
            self._account()
            self._generating -= 1
            flight.generating -= 1
            if flight.generating == 0:
                # the group's last trajectory: its place stays taken until the group is scored
                # and goes to the buffer (see _fly)
                flight.holds_last_place = True
                self._scoring += 1
            self._poke()

    def _on_flight_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())

    def _fail(self, exc: BaseException | None) -> None:
        if self._failure is None and exc is not None:
            self._failure = exc
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _account(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._area += self._generating * (now - self._mark)
        self._mark = now

    def _raise_dead(self) -> None:
        assert self._main is not None
        died_of = None if self._main.cancelled() else self._main.exception()
        cause = self._failure or died_of
        self._surfaced = True
        if cause is None:
            raise RolloutWorkerError("the rollout worker stopped")
        raise RolloutWorkerError(f"the rollout worker failed: {cause!r}") from cause


def build_rollout_worker(
    cfg: AsyncConfig,
    source: Any,
    generate_sample: GenerateSample,
    reward_fn: RewardFn | None,
    *,
    prompts_per_step: int,
    n_samples_per_prompt: int,
    group_filter: GroupFilter | None = None,
) -> RolloutWorker:
    """A worker and its buffer as `cfg` says; `source` has `take(n)` and `give_back(groups)`.

    `prompts_per_step` is the number of groups one `take` serves (the train batch); pass
    `group_filter=verst.rollout.dynamic.has_reward_variance` for DAPO dynamic sampling.
    """
    give_back = source.give_back if cfg.unused == "retry" else None
    worker: RolloutWorker | None = None  # made below; the buffer reports its drops to it

    def dropped(groups: list[Group]) -> None:
        assert worker is not None
        worker.forget(groups)
        if give_back is not None:
            give_back(groups)

    def accepted(group: Group) -> bool:
        assert worker is not None and group_filter is not None
        if group_filter(group):
            return True
        worker.forget([group])
        return False

    buffer = make_buffer(
        cfg.buffer,
        capacity=cfg.buffer_capacity(prompts_per_step),
        max_staleness=cfg.max_staleness,
        give_back=dropped,
        group_filter=accepted if group_filter is not None else None,
    )
    worker = RolloutWorker(
        source,
        buffer,
        generate_sample,
        reward_fn,
        n_samples_per_prompt=n_samples_per_prompt,
        max_inflight=cfg.inflight_limit(prompts_per_step, n_samples_per_prompt),
        replacement=cfg.replacement,
        give_back=give_back,
        max_ahead=cfg.ahead_limit(prompts_per_step),
    )
    return worker
