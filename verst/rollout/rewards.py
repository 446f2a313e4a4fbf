"""Reward functions: the built-ins, loading one by import path, and scoring Samples with one.

A reward function takes a `Sample` and returns a number (sync or async). It reads the response
text from `sample.metadata["response_text"]` (the rollout decodes it with skip_special_tokens).

`RewardScorer` runs one (or a group reward, `rollout.group_reward`, which scores a whole group
in one call: `verst.rollout.group_reward`) under the run's rules, so that one bad sample never
stops the run: a reward function that raises (`SystemExit` included), returns a non-number
(None, a string, NaN, ±inf) or overruns `timeout_s` marks that sample FAILED, with reward 0.0
and the reason in `metadata["reward_error"]`. The loop leaves FAILED samples out of training, as
it does ABORTED ones. Each kind of failure (an exception type, "returned NaN", "returned str",
"timed out") is logged once per scorer, that is once per run, with its first reason;
`take_failed()` counts the failed samples. `KeyboardInterrupt` is not a failure: it stops the
run, as Ctrl-C should.

Timeouts: an async reward runs under `asyncio.wait_for` (it must not block the event loop, nor
swallow the cancellation, or the timeout cannot fire). A sync reward runs on a daemon thread of
the scorer's, one call at a time as it would on the caller's thread, and the clock starts when
its call does. A thread cannot be killed: a call that overruns keeps running on its thread until
the function returns (or the process ends; a daemon thread never holds up the exit), and later
calls go to a new thread. (Not `asyncio.to_thread`: its executor's threads are joined when the
event loop shuts down and at exit, so one hung call would hang the step anyway.) With
`timeout_s=None` a sync reward runs on the caller's thread, unbounded, as a reward that needs
the main thread (e.g. one that times itself with SIGALRM) must.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import queue
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from verst.plugin_loader import load_named
from verst.plugins import GroupRewardFunction, RewardFunction
from verst.types import Group, Sample, Status

log = logging.getLogger(__name__)

# Thousands separators only in well-formed groups ("1,234,567"), so "3,4" reads as 3 then 4;
# a minus right after a word character is an operator ("8-3" ends in 3, not -3).
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


def _response_text(sample: Sample) -> str:
    return str(sample.metadata.get("response_text", ""))


def exact_match(sample: Sample) -> float:
    """1.0 when the response, stripped, equals str(label), stripped; else 0.0."""
    return float(_response_text(sample).strip() == str(sample.label).strip())


def parse_last_number(text: str) -> float | None:
    """The last number in `text` (ints, decimals, negatives, 1,234 thousands); None if none."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return float(matches[-1].replace(",", ""))


def numeric_match(sample: Sample) -> float:
    """1.0 when the last number in the response equals the label within 1e-6; else 0.0."""
    got = parse_last_number(_response_text(sample))
    if got is None:
        return 0.0
    try:
        want = float(str(sample.label).replace(",", "").strip())
    except ValueError:
        want = parse_last_number(str(sample.label))
        if want is None:
            return 0.0
    return float(abs(got - want) <= 1e-6)


def no_reward(sample: Sample) -> float:
    """0.0 for every sample: `rollout.reward: none`, for pure distillation (`loss.opd`), where
    the teacher's verdict on each token is the whole signal."""
    return 0.0


def math_verify(sample: Sample) -> float:
    """1.0 when math-verify finds the response equal to the label (`verst.envs.math_env`)."""
    from verst.envs.math_env import math_verify_reward

    return math_verify_reward(sample)


def reasoning_gym(sample: Sample) -> float:
    """The reasoning-gym dataset's own scorer (`verst.envs.reasoning_gym`), in [0, 1]."""
    from verst.envs.reasoning_gym import reasoning_gym_reward

    return reasoning_gym_reward(sample)


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "math_verify": math_verify,
    "reasoning_gym": reasoning_gym,
    "none": no_reward,
}


def load_reward_fn(path: str, *, field: str = "rollout.reward") -> RewardFunction:
    """A built-in by bare name ("exact_match", "numeric_match"), or any 'pkg.mod:fn' that takes
    a Sample; `PluginError` naming `field` and `path` otherwise."""
    return load_named(path, BUILTIN_REWARDS, RewardFunction, field=field, kind="reward function")


class AdapterRewards:
    """Multi-LoRA: each sample scored by the reward function of its adapter (`Sample.adapter`);
    an async adapter reward returns its awaitable, which the scorer awaits."""

    def __init__(self, fns: dict[str, RewardFunction]) -> None:
        self.fns = fns

    def __call__(self, sample: Sample) -> Any:
        fn = self.fns.get(sample.adapter or "")
        if fn is None:
            raise KeyError(f"sample of adapter {sample.adapter!r}: no reward for it")
        return fn(sample)


class RewardFailure(Exception):
    """Why one reward call gave no usable reward; `kind` groups failures for the log."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def _as_reward(value: Any) -> float:
    """`value` as a finite float; `RewardFailure` otherwise."""
    # Accept anything number-like (bool, numpy scalars, one-element tensors), never text: a
    # reward of "1.0" is almost certainly a bug in the reward function.
    kind = f"returned {type(value).__name__}"
    try:
        if isinstance(value, (str, bytes)) or not (
            isinstance(value, numbers.Real) or hasattr(value, "__float__")
        ):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise RewardFailure(
            kind, f"reward function returned {type(value).__name__} {value!r}, not a number"
        ) from None
    if not math.isfinite(number):
        raise RewardFailure(f"returned {number}", f"reward function returned non-finite {number}")
    return number


def _is_async(fn: Callable) -> bool:
    call = getattr(fn, "__call__", None)  # noqa: B004 (a callable object's async __call__)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


async def _guarded(awaitable: Awaitable[Any]) -> tuple[Any, BaseException | None]:
    """(value, None) or (None, the exception). Caught inside the task that `wait_for` makes, so
    a SystemExit there fails the sample instead of escaping the event loop."""
    try:
        return await awaitable, None
    except (Exception, SystemExit) as error:
        return None, error


def _settle(future: asyncio.Future, outcome: tuple[Any, BaseException | None]) -> None:
    if not future.done():
        future.set_result(outcome)


class RewardScorer:
    """Scores Samples with one reward function under the rules of the module docstring.

    `field` names the config option in log lines ("rollout.reward", "eval.reward"). Use one
    scorer from one thread at a time (the fully async worker has its own).
    """

    def __init__(
        self,
        fn: RewardFunction,
        *,
        timeout_s: float | None = None,
        field: str = "rollout.reward",
        group_fn: GroupRewardFunction | None = None,
    ) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"reward timeout must be > 0 seconds or None, got {timeout_s}")
        self.fn = fn
        self.group_fn = group_fn
        self.timeout_s = timeout_s
        self.field = "rollout.group_reward" if group_fn is not None else field
        self._failed = 0
        self._kinds_logged: set[str] = set()
        self._one_at_a_time: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._thread: _CallThread | None = None  # where sync calls run, one at a time

    async def score(self, samples: list[Sample]) -> None:
        """Set `reward` on every sample (or fail it); async reward calls run concurrently."""
        await asyncio.gather(*(self._score(sample) for sample in samples))

    async def score_group(self, group: Group) -> None:
        """Set `reward` on every sample of `group` not scored yet and not ABORTED (or fail it):
        with the group reward in one call, else sample by sample."""
        unscored = [s for s in group if s.status != Status.ABORTED and s.reward is None]
        if not unscored:
            return
        if self.group_fn is None:
            await self.score(unscored)
            return
        try:
            values = await self._call(self.group_fn, unscored)
            if not isinstance(values, (list, tuple)) or len(values) != len(unscored):
                got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
                raise RewardFailure(
                    "wrong length", f"group reward returned {got}, not {len(unscored)} rewards"
                )
        except RewardFailure as failure:
            for sample in unscored:
                self._fail(sample, failure)
            return
        for sample, value in zip(unscored, values, strict=True):
            try:
                sample.reward = _as_reward(value)
            except RewardFailure as failure:
                self._fail(sample, failure)

    def score_groups(self, groups: list[Group]) -> None:
        """The reward phase of a step: every sample not scored yet gets its reward (the reward
        function may read what an agent returned in `metadata`); ABORTED samples get 0.0."""
        for sample in (s for group in groups for s in group):
            if sample.status == Status.ABORTED:
                sample.reward = 0.0
        todo = [g for g in groups if any(s.reward is None for s in g)]
        if todo:
            asyncio.run(self._score_all(todo))

    async def _score_all(self, groups: list[Group]) -> None:
        await asyncio.gather(*(self.score_group(group) for group in groups))

    def take_failed(self) -> int:
        """Samples whose reward failed since the previous call."""
        failed, self._failed = self._failed, 0
        return failed

    async def _score(self, sample: Sample) -> None:
        try:
            sample.reward = _as_reward(await self._call(self.fn, sample))
        except RewardFailure as failure:
            self._fail(sample, failure)

    async def _call(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        """`fn(arg)`'s value (a reward, or a group's); `RewardFailure` when it raised or
        overran."""
        if _is_async(fn):
            return await self._bounded(fn(arg))
        if self.timeout_s is None:
            value, error = await _guarded(_now(fn, arg))
        else:
            async with self._lock():
                value, error = await self._in_thread(fn, arg)
        _raise_failure(error)
        return await self._bounded(value) if inspect.isawaitable(value) else value

    async def _bounded(self, awaitable: Awaitable[Any]) -> Any:
        try:
            value, error = await asyncio.wait_for(_guarded(awaitable), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._timed_out() from None
        _raise_failure(error)
        return value

    async def _in_thread(
        self, fn: Callable[[Any], Any], arg: Any
    ) -> tuple[Any, BaseException | None]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def call() -> None:
            try:
                outcome: tuple[Any, BaseException | None] = (fn(arg), None)
            except BaseException as error:  # delivered to the caller, which decides
                outcome = (None, error)
            try:
                loop.call_soon_threadsafe(_settle, done, outcome)
            except RuntimeError:  # the loop has closed: nobody waits for this call any more
                pass

        if self._thread is None:
            self._thread = _CallThread()
        self._thread.submit(call)
        try:
            return await asyncio.wait_for(done, self.timeout_s)
        except BaseException as error:  # timed out, or cancelled: the call may never return
            self._thread.retire()
            self._thread = None
            if isinstance(error, asyncio.TimeoutError):
                raise self._timed_out() from None
            raise

    def _timed_out(self) -> RewardFailure:
        return RewardFailure("timed out", f"reward timed out after {self.timeout_s:g} s")

    def _lock(self) -> asyncio.Lock:
        """One sync call at a time per scorer and event loop (a sync loop runs a fresh event
        loop per reward phase, so the lock is made anew for each)."""
        loop = asyncio.get_running_loop()
        if self._one_at_a_time is None or self._one_at_a_time[0] is not loop:
            self._one_at_a_time = (loop, asyncio.Lock())
        return self._one_at_a_time[1]

    def _fail(self, sample: Sample, failure: RewardFailure) -> None:
        sample.reward = 0.0
        sample.status = Status.FAILED
        sample.metadata["reward_error"] = failure.reason
        self._failed += 1
        if failure.kind not in self._kinds_logged:
            self._kinds_logged.add(failure.kind)
            log.warning(
                "%s failed (%s): %s; such samples are marked FAILED and not trained on, with "
                "the reason in metadata['reward_error'] (logged once per kind of failure)",
                self.field,
                failure.kind,
                failure.reason,
            )


class _CallThread:
    """A daemon thread that runs the calls it is given, in turn. Retired when a call overran:
    it ends once that call returns, if ever, and never holds up the process's exit."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="verst-reward", daemon=True).start()

    def submit(self, call: Callable[[], None]) -> None:
        self._calls.put(call)

    def retire(self) -> None:
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            call()


async def _now(fn: Callable[[Any], Any], arg: Any) -> Any:
    return fn(arg)


def _raise_failure(error: BaseException | None) -> None:
    if error is None:
        return
    if not isinstance(error, (Exception, SystemExit)):  # KeyboardInterrupt: stop the run
        raise error
    name = type(error).__name__
    raise RewardFailure(name, f"{name}: {error}") from None


async def compute_rewards(
    samples: list[Sample], fn: RewardFunction, *, timeout_s: float | None = None
) -> None:
    """Set `sample.reward` on every sample with a one-off `RewardScorer` (see the module
    docstring); async reward functions run concurrently."""
    await RewardScorer(fn, timeout_s=timeout_s).score(samples)
