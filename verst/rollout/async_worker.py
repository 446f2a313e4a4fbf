"""The fully asynchronous rollout worker: keeps trajectories generating while the trainer trains.

`RolloutWorker` keeps up to `max_inflight` trajectories (samples) generating. It draws prompts
from the DataSource one group at a time, runs the injected `generate_sample` coroutine on each
sample of the group concurrently, scores the finished group with the reward function, and puts
it into the data buffer (`verst.rollout.buffer`). When the buffer is full the put blocks, and
while a put is blocked no new group starts, so generation drains instead of racing ahead of the
trainer: the buffer's bound is what bounds staleness.

When a new group may start is the job of `verst.rollout.slots.Slots`, a pure state machine that
this worker tells about every event (a group started, a trajectory finished, a put began or
returned, the buffer let go of a group, a group was aborted): it holds the places each group
takes under the replacement rule (`sample`: a finished trajectory frees its place at once;
`group`: a group's places are freed when the whole group has been scored), the puts in progress
and the groups ahead. This module owns the tasks.

Failures: an exception raised by `generate_sample` marks that sample ABORTED (with the reason in
`metadata["abort_error"]`); `max_consecutive_errors`
failures in a row (every generation failing, say the router is down) stop the worker instead of
spinning. An error in the worker itself (the data source, the buffer) stops it too, and
`take` raises `RolloutWorkerError` with the cause, so it never dies silently. A reward that
fails (`verst.rollout.rewards.RewardScorer`: it raised, returned a non-number or timed out)
marks its sample FAILED. The rule is the synchronous loop's: a group with at least
`min_scored_samples` samples neither ABORTED nor FAILED is put whole (the trainer leaves the
others out, `verst.loop.only_scored`); one with fewer is not put at all, but set aside
(`set_aside`, `too few scored samples`) like a group the buffer drops: its prompt is given back
or dropped.

`stop()` cancels everything in flight; groups not yet accepted by the buffer are aborted, and
their prompts go to `give_back` (the DataSource's, with `unused: retry`) or are dropped.
`build_rollout_worker` (`verst.rollout.worker_build`) wires every group the buffer or the
worker will not train to one place that decides, by `unused` and `max_prompt_retries`, whether
its prompt is served again, and records each group's fate in the prompt ledger
(`verst.rollout.ledger`).

Staleness control: a group is not started while `max_ahead` groups are already drawn and not
yet served (generating, at put, or in the buffer): with that many batches ahead of it, it could
only be served stale and dropped. `build_rollout_worker` sets it to `max_staleness` batches
(at least one), the rule AReaL uses to keep asynchronous generation from running ahead of the
trainer.

Due groups: with `max_staleness`, a take at version V first waits for the groups it must serve
for none to go stale (`Slots.due`: those that started max_staleness versions ago, and as many
more of the oldest as the next takes could not fit) while they are still generating, then
takes from the buffer, whose default order serves the oldest groups first. Long trajectories
span the most versions, so a rule that dropped whatever went stale would drop mostly long
ones and bias training toward short responses; waiting for them instead costs the trainer
the time they still need (`buffer/due_wait_s`).

Checkpoints: `unconsumed_prompts()` lists the prompts the worker has drawn that no take has
served yet (generating, or waiting in the buffer), so a checkpoint can hand them back to the
DataSource in its saved state and a resumed run serves them again instead of losing them. The
buffer reports the groups it drops through `forget` (`build_rollout_worker` wires its
`give_back` and filter to it).

`verst train` runs the worker on the fleet's event loop (`verst.fleet.loop_thread.LoopThread`) and
reaches it from the synchronous trainer through that loop. With `monitor.trace`, each group's
generation, reward and put are async spans of the trace, one track a group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from verst.monitor import trace
from verst.plugins import GroupRewardFunction, RewardFunction
from verst.rollout.buffer import (
    Buffer,
    GiveBack,
)
from verst.rollout.ledger import TOO_FEW_SCORED
from verst.rollout.rewards import RewardScorer
from verst.rollout.slots import BEFORE_PUT, Replacement, Slots
from verst.types import Group, Sample, Status, scored_count

log = logging.getLogger(__name__)

GenerateSample = Callable[[Sample], Awaitable[Sample]]
SetAside = Callable[[list[Group], str], None]
"""Takes groups that will not be trained, and why (a `verst.rollout.ledger` reason)."""


class PromptSource(Protocol):
    """What the worker needs from the DataSource."""

    def take(self, n_prompts: int) -> list[Group]: ...


class RolloutWorkerError(RuntimeError):
    """The rollout worker stopped because of an error; `__cause__` is that error."""


@dataclass(eq=False)
class _Flight:
    """A group from its start until its put returns (or `stop` aborts it)."""

    group: Group
    prompts: Group  # untouched copies of the prompt side, to give back or stand in for aborts
    task: asyncio.Task | None = None  # generates, scores and puts the group
    samples: list[asyncio.Task] = field(default_factory=list)  # one generate_sample each

    def tasks(self) -> list[asyncio.Task]:
        return [t for t in (self.task, *self.samples) if t is not None]


def _traced(stage: str, started: int | None, key: int) -> int | None:
    """End the trace's span of a group's stage; the next stage's start."""
    trace.complete(stage, started, cat="rollout", span_id=key, group=key)
    return trace.now()


class _InflightGauge:
    """Time-weighted mean and peak of the trajectories generating, between two readings."""

    def __init__(self) -> None:
        self._value = 0
        self._area = 0.0
        self._peak = 0
        self.restart()

    def restart(self) -> None:
        self._since = self._mark = time.monotonic()

    def set(self, value: int) -> None:
        now = time.monotonic()
        self._area += self._value * (now - self._mark)
        self._mark, self._value = now, value
        self._peak = max(self._peak, value)

    def read(self) -> tuple[float, float]:
        """(mean, peak) since the previous reading; the next window starts now."""
        self.set(self._value)
        elapsed = self._mark - self._since
        mean = self._area / elapsed if elapsed > 0 else float(self._value)
        peak = float(self._peak)
        self._area, self._since, self._peak = 0.0, self._mark, self._value
        return mean, peak


class RolloutWorker:
    """Keeps up to `max_inflight` trajectories generating and feeds finished groups to `buffer`.

    - `source`: `take(1)` returns one group of `n_samples_per_prompt` fresh Samples;
    - `generate_sample(sample) -> sample`: generates one trajectory (in place or a new Sample),
      recording `weight_versions`; an exception aborts that sample;
    - `reward_fn`: a reward function (see `verst.rollout.rewards`) applied to each sample of a
      finished group that is not ABORTED, each call bounded by `reward_timeout_s`; None
      when `generate_sample` sets rewards itself;
    - `min_scored_samples`: a scored group with fewer samples neither ABORTED nor FAILED goes
      to `set_aside(groups, reason)` instead of the buffer (the default: `give_back`, or drop);
    - `give_back`: where the prompts of groups aborted by `stop()` go; None drops them;
    - `max_staleness`: a take waits for the due groups still generating (module docstring);
      None waits for none (the buffer's stale rule alone then drops what comes too late).

    Run it inside an event loop: `await start()`, then `await take(n, version)` per step,
    `metrics()` any time, `await stop()` at the end (or `async with worker:`).
    """

    def __init__(
        self,
        source: PromptSource,
        buffer: Buffer,
        generate_sample: GenerateSample,
        reward_fn: RewardFunction | None,
        *,
        n_samples_per_prompt: int,
        max_inflight: int,
        replacement: Replacement = "sample",
        give_back: GiveBack | None = None,
        max_consecutive_errors: int | None = None,
        max_ahead: int | None = None,
        reward_timeout_s: float | None = None,
        min_scored_samples: int = 1,
        set_aside: SetAside | None = None,
        group_reward_fn: GroupRewardFunction | None = None,
        max_staleness: int | None = None,
    ) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self._slots = Slots(
            n_samples_per_prompt=n_samples_per_prompt,
            max_inflight=max_inflight,
            replacement=replacement,
            max_ahead=max_ahead,
        )
        self.source = source
        self.buffer = buffer
        self.generate_sample = generate_sample
        self.rewards = (
            RewardScorer(reward_fn, timeout_s=reward_timeout_s, group_fn=group_reward_fn)
            if reward_fn is not None
            else None
        )
        self.min_scored_samples = min_scored_samples
        self.max_staleness = max_staleness
        self.give_back = give_back
        self.set_aside = set_aside or self._give_back_or_drop
        self.max_consecutive_errors = max_consecutive_errors or 2 * max_inflight
        self.generate_errors = 0  # cumulative
        self._consecutive_errors = 0
        self._flights: dict[int, _Flight] = {}  # by slot key, until the group's put returns
        # groups handed to the buffer, by id, with their slot key and prompts, until a take
        # serves them or the buffer drops them (`forget`)
        self._in_buffer: dict[int, tuple[int, Group]] = {}
        self._gauge = _InflightGauge()
        self._failure: BaseException | None = None
        self._surfaced = False
        self._main: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._moved: asyncio.Event | None = None  # a group changed phase: a due wait rechecks
        self._due_wait_s = 0.0  # the last take's wait for due groups
        self._due_groups = 0  # the due groups the last take waited for
        self._loop_cpu_s = 0.0  # the loop thread's CPU time at start or the last metrics
        self._stopped = False
        self._paused = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start generating in the running event loop."""
        if self._main is not None:
            raise RuntimeError("the rollout worker was already started")
        self._wake = asyncio.Event()
        self._moved = asyncio.Event()
        self._gauge.restart()
        self._loop_cpu_s = time.thread_time()
        self._main = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Cancel everything in flight, give back (or drop) unfinished groups' prompts.

        Idempotent. Raises `RolloutWorkerError` if the worker had failed and no `take` has
        reported it yet.
        """
        if self._main is None or self._stopped:
            return
        self._stopped = True
        tasks = [self._main, *(t for f in self._flights.values() for t in f.tasks())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        unconsumed = self._abort_flights()
        if unconsumed and self.give_back is not None:
            self.give_back(unconsumed)
        if self._failure is not None and not self._surfaced:
            self._surfaced = True
            raise RolloutWorkerError(f"the rollout worker failed: {self._failure!r}") from (
                self._failure
            )

    async def pause(self) -> None:
        """Start no new group and return once every trajectory in flight has finished (its
        group then goes into the buffer as usual): the engines are idle for an evaluation."""
        self._paused = True
        while self._slots.generating and not (self._main is None or self._main.done()):
            await asyncio.sleep(0.01)

    async def resume(self) -> None:
        self._paused = False
        self._poke()

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
        self._slots.see_version(current_version)
        taking = asyncio.ensure_future(self._take(n_groups, current_version))
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

    async def _take(self, n_groups: int, version: int) -> list[Group]:
        await self._wait_for_due(n_groups, version)
        return await self.buffer.take(n_groups, version)

    async def _wait_for_due(self, n_groups: int, version: int) -> None:
        """Return once no group the take at `version` must serve is still generating."""
        started = time.monotonic()
        waited_for: set[int] = set()
        while self.max_staleness is not None:
            due = self._slots.due(version, self.max_staleness, n_groups)
            if not due:
                break
            waited_for.update(due)
            assert self._moved is not None
            self._moved.clear()
            await self._moved.wait()
        self._due_wait_s = time.monotonic() - started
        self._due_groups = len(waited_for)

    def forget(self, groups: list[Group]) -> None:
        """These groups left the buffer (served, or dropped by its rules): not unconsumed."""
        for group in groups:
            handed = self._in_buffer.pop(id(group), None)
            if handed is not None:
                self._slots.forget(handed[0])
        self._poke()  # fewer groups ahead: one may start

    def unconsumed_prompts(self) -> list[Group]:
        """The prompt side of every group drawn from the source and not yet served by a take
        nor dropped: generating, blocked at put, or waiting in the buffer."""
        phase = self._slots.phase
        generating = [f.prompts for key, f in self._flights.items() if phase(key) in BEFORE_PUT]
        return generating + [prompts for _, prompts in self._in_buffer.values()]

    def metrics(self) -> dict[str, Any]:
        """The buffer's metrics; `buffer/due_wait_s` and `buffer/due_groups`, how long the last
        take waited for due groups (module docstring) and for how many; and `rollout/*`:
        `inflight` (trajectories generating now),
        `inflight_mean` and `inflight_peak` (time-weighted mean and peak since the previous
        call), `inflight_groups` (started, not yet in the buffer), `max_inflight`, `put_blocked`
        (1 when a finished group waits for room), cumulative `groups_started`, `groups_put`,
        `generate_errors`, `reward_errors` (samples whose reward failed since the previous
        call), and `loop_cpu_s`: CPU seconds the worker's event-loop thread used since the
        previous call (the fleet's requests and control calls run there too); called on that
        thread. In the trainer's process that thread competes with the trainer for the GIL."""
        mean, peak = self._gauge.read()
        now = time.thread_time()
        loop_cpu_s, self._loop_cpu_s = now - self._loop_cpu_s, now
        slots = self._slots
        return self.buffer.metrics() | {
            "buffer/due_wait_s": self._due_wait_s,
            "buffer/due_groups": float(self._due_groups),
            "rollout/inflight": float(slots.generating),
            "rollout/inflight_mean": mean,
            "rollout/inflight_peak": peak,
            "rollout/inflight_groups": float(slots.inflight_groups),
            "rollout/max_inflight": float(slots.max_inflight),
            "rollout/put_blocked": float(slots.putting > 0),
            "rollout/groups_started": float(slots.groups_started),
            "rollout/groups_put": float(slots.groups_put),
            "rollout/generate_errors": float(self.generate_errors),
            "rollout/reward_errors": float(self.rewards.take_failed() if self.rewards else 0),
            "rollout/loop_cpu_s": loop_cpu_s,
        }

    @property
    def inflight(self) -> int:
        """Trajectories inside `generate_sample` now."""
        return self._slots.generating

    @property
    def occupied(self) -> int:
        """Places held under the replacement rule (at most `max_inflight`)."""
        return self._slots.occupied

    @property
    def groups_started(self) -> int:
        return self._slots.groups_started

    @property
    def groups_put(self) -> int:
        """Groups whose put returned, kept by the buffer or dropped by its rules."""
        return self._slots.groups_put

    @property
    def aborted_on_stop(self) -> int:
        return self._slots.groups_aborted

    @property
    def n_samples_per_prompt(self) -> int:
        return self._slots.n_samples_per_prompt

    @property
    def max_inflight(self) -> int:
        return self._slots.max_inflight

    @property
    def replacement(self) -> Replacement:
        return self._slots.replacement

    @property
    def max_ahead(self) -> int | None:
        return self._slots.max_ahead

    # -- the worker ----------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if self._failure is not None:
                raise self._failure
            if not self._paused and self._slots.may_start():
                self._launch()
                continue
            self._wake.clear()
            await self._wake.wait()

    def _launch(self) -> None:
        group = self._draw()
        key = self._slots.start()
        self._gauge.set(self._slots.generating)
        flight = _Flight(group=group, prompts=[s.clone_prompt(s.index) for s in group])
        self._flights[key] = flight
        flight.task = asyncio.ensure_future(self._fly(key, flight))
        flight.task.add_done_callback(self._on_flight_done)

    def _draw(self) -> Group:
        groups = self.source.take(1)
        if len(groups) != 1 or len(groups[0]) != self.n_samples_per_prompt:
            sizes = [len(g) for g in groups]
            raise RuntimeError(
                f"source.take(1) returned groups of sizes {sizes}, "
                f"expected one group of {self.n_samples_per_prompt}"
            )
        return groups[0]

    async def _fly(self, key: int, flight: _Flight) -> None:
        traced = trace.now()  # each stage of the group an async span of the trace
        flight.samples = [
            asyncio.ensure_future(self._generate(key, sample, prompt))
            for sample, prompt in zip(flight.group, flight.prompts, strict=True)
        ]
        flight.group = list(await asyncio.gather(*flight.samples))
        for sample, prompt in zip(flight.group, flight.prompts, strict=True):
            sample.prompt_id, sample.epoch = prompt.prompt_id, prompt.epoch  # a new Sample, say
            sample.retries = prompt.retries
        traced = _traced("group generate", traced, key)
        if self.rewards is not None:  # its ABORTED samples are left unscored
            await self.rewards.score_group(flight.group)
            traced = _traced("group reward", traced, key)
        self._in_buffer[id(flight.group)] = (key, flight.prompts)  # a drop at put forgets it
        self._slots.put_begin(key)
        self._poke()  # handed over: a take waiting for it as due may go on, even if put blocks
        if scored_count(flight.group) < self.min_scored_samples:
            self.set_aside([flight.group], TOO_FEW_SCORED)
        else:
            await self.buffer.put(flight.group)
            _traced("group put", traced, key)
        # accepted (or dropped by the buffer's rules, or set aside): no longer ours to give back
        self._slots.put_end(key)
        del self._flights[key]
        self._poke()

    async def _generate(self, key: int, sample: Sample, prompt: Sample) -> Sample:
        try:
            result = await self.generate_sample(sample)
            if not isinstance(result, Sample):
                raise TypeError(f"generate_sample returned a {type(result).__name__}, not a Sample")
            self._consecutive_errors = 0
            return result
        except Exception as exc:
            return self._failed(prompt, exc)
        finally:
            self._slots.finish_sample(key)
            self._gauge.set(self._slots.generating)
            self._poke()

    def _give_back_or_drop(self, groups: list[Group], reason: str) -> None:
        self.forget(groups)
        if self.give_back is not None:
            self.give_back(groups)

    def _failed(self, prompt: Sample, exc: Exception) -> Sample:
        """Count a failed generation; an aborted copy of the prompt stands in for its sample."""
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

    def _abort_flights(self) -> list[Group]:
        """Abort every group whose put has not returned; the prompts of those still unconsumed."""
        unconsumed = []
        for key, flight in self._flights.items():
            for sample in flight.group:
                if sample.status == Status.PENDING:
                    sample.status = Status.ABORTED
            self._in_buffer.pop(id(flight.group), None)  # a put cancelled adds nothing
            if self._slots.abort(key):
                unconsumed.append(flight.prompts)
        self._flights.clear()
        self._gauge.set(self._slots.generating)
        return unconsumed

    def _on_flight_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            if not self._stopped:  # its places would stay held: stop rather than shrink
                self._fail(RolloutWorkerError("a group's generation was cancelled"))
        elif task.exception() is not None:
            self._fail(task.exception())

    def _fail(self, exc: BaseException | None) -> None:
        if self._failure is None and exc is not None:
            self._failure = exc
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()
        if self._moved is not None:
            self._moved.set()

    def _raise_dead(self) -> None:
        assert self._main is not None
        died_of = None if self._main.cancelled() else self._main.exception()
        cause = self._failure or died_of
        self._surfaced = True
        if cause is None:
            raise RolloutWorkerError("the rollout worker stopped")
        raise RolloutWorkerError(f"the rollout worker failed: {cause!r}") from cause
