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
The version is the trainer's integer; engines carry it as a string, as SGLang does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from verst.plugins import EngineClient, NamedTensors, WeightTransport

PauseMode = Literal["retract", "in_place", "abort"]


class WeightSyncError(RuntimeError):
    """Some engines still run other weights after the resends."""


@dataclass
class PushReport:
    version: int
    seconds: float
    resent: list[int] = field(default_factory=list)  # indices of engines sent twice or more
    calls: list[str] = field(default_factory=list)  # the protocol's steps, in order


class WeightSync:
    def __init__(
        self,
        engines: list[EngineClient],
        transport: WeightTransport,
        *,
        pause_mode: PauseMode = "retract",
        max_resends: int = 1,
    ) -> None:
        self.engines = list(engines)
        self.transport = transport
        self.pause_mode = pause_mode
        self.max_resends = max_resends

    async def push(self, tensors: NamedTensors, version: int) -> PushReport:
        """Run the whole protocol for `version` on every engine."""
        started = time.perf_counter()
        report = PushReport(version=version, seconds=0.0)
        engines = self.engines

        async def each(step: str, call: Callable[[EngineClient], object]) -> list[object]:
            report.calls.append(step)
            return list(await asyncio.gather(*(call(e) for e in engines)))

        await each("pause", lambda e: e.pause_generation(self.pause_mode))
        if self.pause_mode != "in_place":
            flushed = await each("flush", lambda e: e.flush_cache())
            if not all(flushed):
                raise WeightSyncError(f"flush_cache refused by engines {_false(flushed)}")
        report.calls.append("send")
        await self.transport.send(engines, tensors, version)
        await each("set_version", lambda e: e.update_weight_version(str(version)))
        await each("continue", lambda e: e.continue_generation())
        await self._confirm(tensors, version, report)
        report.seconds = time.perf_counter() - started
        return report

    async def _confirm(self, tensors: NamedTensors, version: int, report: PushReport) -> None:
        for attempt in range(self.max_resends + 1):
            versions = await asyncio.gather(*(e.get_weight_version() for e in self.engines))
            stale = [i for i, v in enumerate(versions) if v != str(version)]
            if not stale:
                return
            if attempt == self.max_resends:
                raise WeightSyncError(
                    f"engines {stale} report versions {[versions[i] for i in stale]} after "
                    f"{self.max_resends} resends of version {version}"
                )
            report.resent += stale
            await self._full_push([self.engines[i] for i in stale], tensors, version)

    async def add_engine(self, engine: EngineClient, tensors: NamedTensors, version: int) -> None:
        """A joining engine gets the current weights and version before it serves."""
        await self._full_push([engine], tensors, version)
        self.engines.append(engine)

    async def _full_push(
        self, engines: list[EngineClient], tensors: NamedTensors, version: int
    ) -> None:
        await asyncio.gather(*(e.pause_generation(self.pause_mode) for e in engines))
        await self.transport.send(engines, tensors, version)
        await asyncio.gather(*(e.update_weight_version(str(version)) for e in engines))
        await asyncio.gather(*(e.continue_generation() for e in engines))


def _false(results: list[object]) -> list[int]:
    return [i for i, ok in enumerate(results) if not ok]
