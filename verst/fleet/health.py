"""Engine health: a monitor that finds failed engine processes so the fleet can restart them.

Every `interval_s` the monitor checks each serving engine of a fleet, all at once:

- its process has not exited;
- it answers `GET /health_generate` (a one-token generation through the scheduler) within
  `timeout_s`, or, when the probe waits behind a full batch, it answers `/v1/loads` and runs
  requests; while a weight push is in progress the engines are paused, so it is asked only
  `GET /health` (the serving loop is alive) then;
- once weights have been pushed, it reports the fleet's weight version (checked only when no
  push began or ran during the check).

An engine that fails a check is handed to `Fleet.lose`, which kills it, takes it out of routing
and restarts it in place. Engines in the trainer's process cannot be restarted, so the monitor
runs only with `placement.engines: processes`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import Field

from verst.configbase import ConfigBase
from verst.plugins import EngineClient

log = logging.getLogger(__name__)


class FaultToleranceConfig(ConfigBase):
    enabled: bool | None = Field(
        None,
        description="check engine processes and restart a failed one in place; null = on with "
        "placement.engines=processes (in-process engines cannot be restarted)",
    )
    interval_s: float = Field(5.0, gt=0, description="seconds between two health checks")
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="an engine that does not answer a health check or a weight push's control "
        "call within this many seconds has failed",
    )
    max_engine_restarts: int = Field(
        20, ge=0, description="engine restarts in one run; one more failure stops the run"
    )

    def active(self, engines: str) -> bool:
        """Whether engines placed as `engines` are monitored and restarted."""
        return engines == "processes" if self.enabled is None else self.enabled


class EngineRestartError(RuntimeError):
    """A failed engine could not be restarted, or the run used up its restarts."""


@dataclass
class FaultCounters:
    """What failures cost a run so far: `fault/*` metrics."""

    engine_restarts: int = 0
    retried_groups: int = 0  # groups (routing keys) with a request sent again elsewhere
    _down_s: float = 0.0  # engine-seconds down, of outages that ended
    _down_since: dict[int, float] = field(default_factory=dict)  # by process slot

    def down(self, slot: int) -> None:
        self._down_since.setdefault(slot, time.monotonic())

    def up(self, slot: int) -> None:
        since = self._down_since.pop(slot, None)
        if since is not None:
            self._down_s += time.monotonic() - since

    def metrics(self) -> dict[str, float]:
        now = time.monotonic()
        ongoing = sum(now - since for since in self._down_since.values())
        return {
            "fault/engine_restarts": float(self.engine_restarts),
            "fault/engine_down_s": self._down_s + ongoing,
            "fault/engines_down": float(len(self._down_since)),
            "fault/retried_groups": float(self.retried_groups),
        }


class MonitoredFleet(Protocol):
    """What the monitor reads of a fleet (`verst.fleet.fleet.Fleet`), and `lose`."""

    weight_version: int
    pushing: bool  # a weight push is in progress: the engines are paused
    pushes_begun: int
    pushes_done: int

    def serving_engines(self) -> dict[str, EngineClient]: ...

    def exit_code(self, url: str) -> int | None: ...

    def lose(self, url: str, reason: str) -> None: ...


class EngineMonitor:
    """The periodic checks of one fleet, as a task on the fleet's event loop."""

    def __init__(self, fleet: MonitoredFleet, cfg: FaultToleranceConfig) -> None:
        self.fleet = fleet
        self.cfg = cfg
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start checking (call on the fleet's loop)."""
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.check_all()
            except Exception:  # a monitor that dies would leave failures unseen
                log.exception("engine health check failed")

    async def check_all(self) -> dict[str, str]:
        """Check every serving engine once; those that fail are lost. Returns their problems."""
        engines = self.fleet.serving_engines()
        problems = await asyncio.gather(*(self.problem(url, c) for url, c in engines.items()))
        failed = {url: p for url, p in zip(engines, problems, strict=True) if p is not None}
        for url, problem in failed.items():
            self.fleet.lose(url, problem)
        return failed

    async def _busy(self, client: EngineClient) -> bool:
        """A probe token may wait behind a full batch of long generations: an engine whose
        serving loop answers and that runs requests is busy, not hung (a hung step is found by
        the next weight push, whose control calls are bounded)."""
        try:
            load = await asyncio.wait_for(client.get_load(), self.cfg.timeout_s)
            running = sum(int(rank["num_running_reqs"]) for rank in load["loads"])
        except Exception:
            return False
        return running > 0

    async def problem(self, url: str, client: EngineClient) -> str | None:
        """Why the engine at `url` has failed, or None when it is healthy."""
        code = self.fleet.exit_code(url)
        if code is not None:
            return f"its process exited with code {code}"
        pushes = self.fleet.pushes_begun
        pushing = self.fleet.pushing
        probe = client.health() if pushing else client.health_generate()
        try:
            ok = await asyncio.wait_for(probe, self.cfg.timeout_s)
        except TimeoutError:
            if self.fleet.pushes_begun != pushes and not pushing:
                return None  # a push paused the engine under the probe: no verdict
            if not pushing and await self._busy(client):
                return None
            return f"no answer to a health check within {self.cfg.timeout_s:g} s"
        if not ok:
            return "it failed a health check"
        if pushing or self.fleet.pushes_done == 0:
            return None
        try:
            version = await asyncio.wait_for(client.get_weight_version(), self.cfg.timeout_s)
        except TimeoutError:
            return f"no answer to a weight version query within {self.cfg.timeout_s:g} s"
        except Exception as error:  # an engine that cannot say its version cannot serve it
            return f"its weight version could not be read ({error})"
        if self.fleet.pushing or self.fleet.pushes_begun != pushes:
            return None  # a push changed the version meanwhile
        expected = str(self.fleet.weight_version)
        if version != expected:
            return f"it reports weight version {version!r}, the fleet's is {expected!r}"
        return None
