"""The weight-update protocol every transport follows, over any set of `EngineClient`s and any
`WeightTransport` (both contracts are in `verst.plugins`).

One update, in order:
1. pause every engine (`retract`, `in_place` or `abort`);
2. flush every engine's prefix cache, unless the pause was `in_place` (frozen requests keep
   their KV, so their cache stays);
3. send the weights through the transport;
4. stamp the new version on every engine;
5. continue generation;
6. ask every engine for its version: one that does not report the new version is sent the
   weights again (at most `max_resends` times) and, if it still disagrees, reported.

An engine that joins (or rejoins) gets a full push before it serves: `add_engine`.

A transport that can run steps 1-6 in one request to an engine (`WholeUpdates`: the colocated
and broadcast transports, to `verst serve` engines) is given those engines first; the report's
calls then read `update` for them, and the others go through the steps above. The engine runs
that request between two scheduler steps and answers the new version, so it keeps every
guarantee of the steps (`WeightUpdates.update_weights_from_buffers` says why).

With LoRA the weights of a push are adapters (`AdapterUpdate`s): the frozen base never moves,
and step 3 sends each adapter in turn, addressed to the engines' adapter registry.
The version is the trainer's integer; engines carry it as a string, as SGLang does. Each step's
seconds go into the push's report (`PushReport.step_seconds`; `perf/sync_<step>_time_s` in the
run's metrics, a span each in its trace).

Engines that fail during a push: with `on_engine_lost`, an engine whose control call raises or
takes longer than `call_timeout_s`, or that is found dead after a failed send, is handed to
`on_engine_lost(engine, reason)` and left out of the rest of the push, which carries on with the
others (the send is repeated for them, on a transport that re-forms itself, such as a broadcast
group); the push fails only when no engine is left. Without it, the first failure raises
`WeightSyncError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from verst.monitor import trace
from verst.plugins import AdapterUpdate, EngineClient, NamedTensors, WeightTransport

PauseMode = Literal["retract", "in_place", "abort"]
Weights = NamedTensors | list[AdapterUpdate]
"""What a push installs: the whole model's tensors, or (LoRA) some adapters."""


class WeightSyncError(RuntimeError):
    """Some engines still run other weights after the resends, or no engine is left."""


class EveryEngineLost(WeightSyncError):
    """Every engine of a push failed during it."""


EngineLost = Callable[[EngineClient, str], None]


@dataclass
class PushReport:
    version: int
    seconds: float
    resent: list[int] = field(default_factory=list)  # indices of engines sent twice or more
    calls: list[str] = field(default_factory=list)  # the protocol's steps, in order
    engines: list[EngineClient] = field(default_factory=list)  # those that hold the version
    lost: list[EngineClient] = field(default_factory=list)  # those handed to on_engine_lost
    # seconds of each step: pause, flush, send, set_version, continue, confirm (with resends)
    step_seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timed(self, step: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            with trace.span(f"sync {step}", cat="sync", version=self.version):
                yield
        finally:
            elapsed = time.perf_counter() - started
            self.step_seconds[step] = self.step_seconds.get(step, 0.0) + elapsed


@runtime_checkable
class WholeUpdates(Protocol):
    """A transport that runs the whole protocol (pause, flush, send, version, continue, with the
    version in the answer) in one request to some engines."""

    async def whole_update_engines(self, engines: list[EngineClient]) -> list[EngineClient]:
        """Those of `engines` that take the one request."""
        ...

    async def update_whole(
        self,
        engines: list[EngineClient],
        tensors: NamedTensors,
        version: int,
        pause_mode: str,
        timeout_s: float | None = None,
    ) -> dict[EngineClient, BaseException | None]:
        """Each engine's failure (no answer within `timeout_s` is one), or None where it now
        runs `version`."""
        ...


async def takes_whole_updates(engines: list[EngineClient]) -> list[bool]:
    """Whether each engine takes verst's whole-update requests (its `takes_whole_updates`); one
    that cannot say (no such call, or the call failed) is left to the stepwise protocol."""

    async def takes(engine: EngineClient) -> bool:
        ask = getattr(engine, "takes_whole_updates", None)
        return ask is not None and bool(await ask())

    answers = await asyncio.gather(*(takes(e) for e in engines), return_exceptions=True)
    return [answer is True for answer in answers]


class WeightSync:
    def __init__(
        self,
        engines: list[EngineClient],
        transport: WeightTransport,
        *,
        pause_mode: PauseMode = "retract",
        max_resends: int = 1,
        on_engine_lost: EngineLost | None = None,
        call_timeout_s: float | None = None,
        repeat_send: bool = True,
    ) -> None:
        self.engines = list(engines)
        self.transport = transport
        self.pause_mode = pause_mode
        self.max_resends = max_resends
        self.on_engine_lost = on_engine_lost
        self.call_timeout_s = call_timeout_s
        # False when the tensors can be walked only once a push (under torchrun every walk
        # is a gather the other ranks join once): a failed send then fails the push
        self.repeat_send = repeat_send

    async def push(
        self, tensors: Weights, version: int, engines: list[EngineClient] | None = None
    ) -> PushReport:
        """Run the whole protocol for `version` on `engines` (default: every engine)."""
        started = time.perf_counter()
        report = PushReport(version=version, seconds=0.0)
        report.engines = list(self.engines if engines is None else engines)
        whole = await self._whole_engines(report, tensors)
        if whole:
            report.calls.append("update")
            with report.timed("update"):
                await self._update_whole(report, whole, tensors, version)
        stepwise = [e for e in report.engines if e not in whole]
        if stepwise:
            await self._stepwise(report, stepwise, tensors, version)
        report.seconds = time.perf_counter() - started
        return report

    async def _stepwise(
        self, report: PushReport, among: list[EngineClient], tensors: Weights, version: int
    ) -> None:
        """Steps 1-6, a call each, on the engines `among`."""

        async def each(step: str, call: Callable[[EngineClient], Awaitable[Any]]) -> list[Any]:
            report.calls.append(step)
            with report.timed(step):
                return await self._each(report, step, call, among)

        await each("pause", lambda e: e.pause_generation(self.pause_mode))
        if self.pause_mode != "in_place":
            flushed = await each("flush", lambda e: e.flush_cache())
            if not all(flushed):
                raise WeightSyncError(f"flush_cache refused by engines {_false(flushed)}")
        report.calls.append("send")
        with report.timed("send"):
            await self._send(report, tensors, version, among)
        await each("set_version", lambda e: e.update_weight_version(str(version)))
        await each("continue", lambda e: e.continue_generation())
        with report.timed("confirm"):
            await self._confirm(tensors, version, report, among)

    async def _whole_engines(self, report: PushReport, tensors: Weights) -> list[EngineClient]:
        """The engines the transport updates in one request each (a model's tensors only, not
        LoRA adapters). When the tensors can be walked only once a push, only if that is every
        engine: the others would need a second walk."""
        if not isinstance(self.transport, WholeUpdates) or not callable(tensors):
            return []
        whole = await self.transport.whole_update_engines(list(report.engines))
        if not self.repeat_send and len(whole) != len(report.engines):
            return []
        return whole

    async def _update_whole(
        self, report: PushReport, whole: list[EngineClient], tensors: NamedTensors, version: int
    ) -> None:
        """The one-request update. As after a failed send, the engines that failed it and are
        found dead are lost and the update is repeated for those alive that failed (on a
        broadcast group a hung member stalls every other's update; the transport re-forms the
        group without it); with none dead, an alive engine that failed fails the push."""
        assert isinstance(self.transport, WholeUpdates)
        engines = list(whole)
        while engines:
            failures = await self.transport.update_whole(
                engines, tensors, version, self.pause_mode, self.call_timeout_s
            )
            failed = [(e, error) for e, error in failures.items() if error is not None]
            if failed and self.on_engine_lost is None:
                raise failed[0][1]
            alive = await asyncio.gather(*(self._alive(e) for e, _ in failed))
            if failed and all(alive):
                engine, error = failed[0]
                raise WeightSyncError(
                    f"engine {_index(self.engines, engine)} is alive but failed the update to "
                    f"version {version}: {_describe(error)}"
                ) from error
            for (engine, error), ok in zip(failed, alive, strict=True):
                if not ok:
                    self._lose(report, engine, f"update failed: {_describe(error)}", error)
            retry = [(e, error) for (e, error), ok in zip(failed, alive, strict=True) if ok]
            if retry and not self.repeat_send:
                raise WeightSyncError(
                    f"the update to version {version} failed ({_describe(retry[0][1])}), and "
                    "it cannot be repeated: the other trainer ranks gathered the weights once"
                ) from retry[0][1]
            engines = [e for e, _ in retry]

    async def _each(
        self,
        report: PushReport,
        step: str,
        call: Callable[[EngineClient], Awaitable[Any]],
        among: list[EngineClient],
    ) -> list[Any]:
        """`call` on the push's engines `among` at once; an engine that fails it is lost."""
        engines = [e for e in report.engines if e in among]
        results = await asyncio.gather(
            *(self._bounded(call(e)) for e in engines), return_exceptions=True
        )
        kept = []
        for engine, result in zip(engines, results, strict=True):
            if isinstance(result, BaseException):
                self._lose(report, engine, f"{step} failed: {_describe(result)}", result)
            else:
                kept.append(result)
        return kept

    async def _bounded(self, call: Awaitable[Any]) -> Any:
        if self.call_timeout_s is None:
            return await call
        try:
            return await asyncio.wait_for(call, self.call_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no answer within {self.call_timeout_s:g} s") from None

    def _lose(
        self, report: PushReport, engine: EngineClient, reason: str, error: BaseException
    ) -> None:
        if self.on_engine_lost is None:
            raise WeightSyncError(f"engine {_index(self.engines, engine)}: {reason}") from error
        report.engines.remove(engine)
        report.lost.append(engine)
        if engine in self.engines:
            self.engines.remove(engine)
        self.on_engine_lost(engine, reason)
        if not report.engines:
            raise EveryEngineLost(
                f"every engine failed during the push of version {report.version}; last: {reason}"
            ) from error

    async def _send(
        self, report: PushReport, tensors: Weights, version: int, among: list[EngineClient]
    ) -> None:
        """The transport's send to the push's engines `among`; after a failure, the engines
        found dead are lost and the send is repeated for the others (each retry loses at least
        one)."""
        while True:
            engines = [e for e in report.engines if e in among]
            try:
                await self._transport_send(engines, tensors, version)
                return
            except Exception as error:
                if self.on_engine_lost is None:
                    raise
                if not self.repeat_send:
                    raise WeightSyncError(
                        f"sending version {version} failed ({_describe(error)}), and the send "
                        "cannot be repeated: the other trainer ranks gathered the weights once"
                    ) from error
                alive = await asyncio.gather(*(self._alive(e) for e in engines))
                dead = [e for e, ok in zip(engines, alive, strict=True) if not ok]
                if not dead:
                    raise WeightSyncError(
                        f"sending version {version} failed while every engine is alive: "
                        f"{_describe(error)}"
                    ) from error
                for engine in dead:
                    self._lose(report, engine, f"send failed: {_describe(error)}", error)

    async def _alive(self, engine: EngineClient) -> bool:
        try:
            return bool(await self._bounded(engine.health()))
        except Exception:
            return False

    async def _confirm(
        self, tensors: Weights, version: int, report: PushReport, among: list[EngineClient]
    ) -> None:
        for attempt in range(self.max_resends + 1):
            engines = [e for e in report.engines if e in among]
            versions = await self._each(
                report, "get_version", lambda e: e.get_weight_version(), among
            )
            engines = [e for e in engines if e in report.engines]  # those that answered
            stale = [i for i, v in enumerate(versions) if v != str(version)]
            if not stale:
                return
            if attempt == self.max_resends:
                raise WeightSyncError(
                    f"engines {stale} report versions {[versions[i] for i in stale]} after "
                    f"{self.max_resends} resends of version {version}"
                )
            report.resent += stale
            await self._full_push([engines[i] for i in stale], tensors, version)

    async def add_engine(self, engine: EngineClient, tensors: Weights, version: int) -> None:
        """A joining engine gets the current weights and version before it serves."""
        await self._full_push([engine], tensors, version)
        self.engines.append(engine)

    async def _full_push(self, engines: list[EngineClient], tensors: Weights, version: int) -> None:
        await asyncio.gather(*(e.pause_generation(self.pause_mode) for e in engines))
        await self._transport_send(engines, tensors, version)
        await asyncio.gather(*(e.update_weight_version(str(version)) for e in engines))
        await asyncio.gather(*(e.continue_generation() for e in engines))

    async def _transport_send(
        self, engines: list[EngineClient], tensors: Weights, version: int
    ) -> None:
        if callable(tensors):
            await self.transport.send(engines, tensors, version)
            return
        for adapter in tensors:
            await self.transport.send(engines, adapter.tensors, version, adapter=adapter)


def _false(results: list[object]) -> list[int]:
    return [i for i, ok in enumerate(results) if not ok]


def _index(engines: list[EngineClient], engine: EngineClient) -> int | str:
    return engines.index(engine) if engine in engines else "?"


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
