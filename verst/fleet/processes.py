"""The engine processes of a fleet: one slot per engine, holding its device and seed.

Every slot's `verst serve` process is started at once at the beginning of a run
(`start_all`); after a failure, one slot's process is killed and started again on the same
device with the same arguments (`restart`), on a fresh port. A restarted engine loads the
run's initial weights (`model_dir`); the fleet's weight sync gives it the current ones before
it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verst.fleet.launcher import LocalEngine, launch_local_engines


@dataclass
class ProcessSlot:
    index: int
    device: str
    seed: int
    engine: LocalEngine | None = None  # None while down
    restarts: int = 0

    @property
    def url(self) -> str | None:
        return None if self.engine is None else self.engine.url


class EngineProcesses:
    def __init__(
        self,
        model_dir: Path,
        devices: list[str],
        *,
        common_args: list[str],
        seed: int,
        timeout_s: float,
        env: dict[str, str],
        nice: int = 0,
    ) -> None:
        self.model_dir = model_dir
        self.nice = nice
        self.common_args = common_args
        self.timeout_s = timeout_s
        self.env = env
        self.slots = [ProcessSlot(i, device, seed + i) for i, device in enumerate(devices)]
        self.closed = False

    @property
    def devices(self) -> list[str]:
        return [slot.device for slot in self.slots]

    @property
    def engines(self) -> list[LocalEngine]:
        """The running processes, in slot order."""
        return [slot.engine for slot in self.slots if slot.engine is not None]

    def _args(self, slot: ProcessSlot) -> list[str]:
        return ["--device", slot.device, "--seed", str(slot.seed)]

    def start_all(self) -> None:
        """Every slot's process, started together and waited on together."""
        engines = launch_local_engines(
            self.model_dir,
            len(self.slots),
            extra_args=self.common_args,
            engine_args=[self._args(slot) for slot in self.slots],
            timeout_s=self.timeout_s,
            env=self.env,
            nice=self.nice,
        )
        for slot, engine in zip(self.slots, engines, strict=True):
            slot.engine = engine

    def slot_of(self, url: str) -> ProcessSlot | None:
        return next((slot for slot in self.slots if slot.url == url), None)

    def exit_code(self, url: str) -> int | None:
        """The exit code of the process serving `url`, None while it runs (or is unknown)."""
        slot = self.slot_of(url)
        if slot is None or slot.engine is None:
            return None
        return slot.engine.process.poll()

    def kill(self, slot: ProcessSlot) -> None:
        """SIGKILL: a failed engine gets no grace (it may be hung)."""
        if slot.engine is not None:
            slot.engine.kill()
            slot.engine = None

    def restart(self, slot: ProcessSlot) -> LocalEngine:
        """A new process for `slot` (blocking until it is healthy; run it off the event loop)."""
        self.kill(slot)
        slot.restarts += 1
        (engine,) = launch_local_engines(
            self.model_dir,
            1,
            extra_args=self.common_args,
            engine_args=[self._args(slot)],
            timeout_s=self.timeout_s,
            env=self.env,
            nice=self.nice,
        )
        if self.closed:  # the fleet closed while this process started
            engine.stop()
            raise RuntimeError("the fleet closed while the engine restarted")
        slot.engine = engine
        return engine

    def stop_all(self) -> None:
        self.closed = True
        for slot in self.slots:
            if slot.engine is not None:
                slot.engine.stop()
                slot.engine = None
