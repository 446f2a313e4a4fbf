"""Engine processes placed by Ray: each slot's `verst serve` runs under an `EngineHost` actor in
the slot's bundle of the run's placement group, on whichever node Ray put that bundle.

The actor starts the same `verst serve` command a local fleet starts (`verst.fleet.launcher`),
bound to its node's address, and reports the URL, which is how the fleet's router learns where
the engine is. A failed engine (its process dead, or its actor) is restarted as a local one is:
the fleet kills the slot's actor and starts a new one in the same bundle (`restart`), which
serves after a full weight push.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verst.fleet.launcher import launch_local_engines
from verst.fleet.processes import EngineProcesses, ProcessSlot
from verst.fleet.ray_cluster import join_from_rank, require_ray, scheduling

log = logging.getLogger(__name__)
DEAD = -9  # the exit code reported for an engine whose actor is gone


class EngineHost:
    """The Ray actor of one engine: owns its `verst serve` process on the actor's node."""

    def __init__(self) -> None:
        self.engine: Any = None

    def start(
        self,
        model_dir: str,
        args: list[str],
        device: str,
        timeout_s: float,
        env: dict,
        nice: int = 0,
    ) -> tuple[str, str, int, str]:
        """Start `verst serve` on this node; returns (url, node id, pid, device) once it is
        healthy."""
        import ray

        host = ray.util.get_node_ip_address()
        if device == "auto":
            device = "cuda" if ray.get_gpu_ids() else "cpu"
        (self.engine,) = launch_local_engines(
            model_dir,
            1,
            host=host,
            extra_args=[*args, "--device", device],
            timeout_s=timeout_s,
            env=env,
            nice=nice,
        )
        node = ray.get_runtime_context().get_node_id()
        return self.engine.url, node, self.engine.process.pid, device

    def poll(self) -> int | None:
        return None if self.engine is None else self.engine.process.poll()

    def sees(self, path: str) -> bool:
        return Path(path).exists()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()


@dataclass
class RayEngine:
    """What the fleet knows of an engine placed by Ray: its URL, node and host actor."""

    url: str
    node: str
    pid: int
    actor: Any

    def exit_code(self) -> int | None:
        ray = require_ray()
        try:
            return ray.get(self.actor.poll.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return DEAD

    def kill(self) -> None:
        require_ray().kill(self.actor)

    def stop(self) -> None:
        ray = require_ray()
        try:
            ray.get(self.actor.stop.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # gone already, or hung: killed below either way
        ray.kill(self.actor)


class RayEngineProcesses(EngineProcesses):
    """`EngineProcesses` whose slots are Ray actors in bundles `first_bundle + slot index` of
    the run's placement group (found through the trainer rank's environment)."""

    def __init__(self, *args: Any, first_bundle: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = join_from_rank()
        self.first_bundle = first_bundle

    def _launch(self, slot: ProcessSlot) -> Any:
        ray = require_ray()
        index = self.first_bundle + slot.index
        bundle = self.group.bundle_specs[index]
        # the actor holds its bundle's CPUs and GPUs, so Ray gives the serve process (its
        # child) the bundle's GPUs through CUDA_VISIBLE_DEVICES
        host = ray.remote(EngineHost).options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=scheduling(self.group, index),
        )
        actor = host.remote()
        seed = ["--seed", str(slot.seed)]
        env = {**self.env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        call = actor.start.remote(
            str(self.model_dir),
            [*self.common_args, *seed],
            slot.device,
            self.timeout_s,
            env,
            self.nice,
        )
        return actor, call

    def _join(self, slot: ProcessSlot, actor: Any, call: Any) -> RayEngine:
        ray = require_ray()
        try:
            url, node, pid, device = ray.get(call, timeout=self.timeout_s + 30)
        except BaseException:
            ray.kill(actor)
            raise
        slot.device = device  # "auto" resolved: the bundle's GPU, or the CPU
        return RayEngine(url, node, pid, actor)

    def start_all(self) -> None:
        launched = [self._launch(slot) for slot in self.slots]  # their start-ups overlap
        try:
            for slot, (actor, call) in zip(self.slots, launched, strict=True):
                slot.engine = self._join(slot, actor, call)  # type: ignore[assignment]
                log.info("engine %d at %s on Ray node %s", slot.index, slot.url, slot.engine.node)  # type: ignore[union-attr]
        except BaseException:
            for actor, _ in launched:
                require_ray().kill(actor)
            raise

    def exit_code(self, url: str) -> int | None:
        slot = self.slot_of(url)
        if slot is None or slot.engine is None:
            return None
        return slot.engine.exit_code()  # type: ignore[attr-defined]

    def restart(self, slot: ProcessSlot) -> Any:
        self.kill(slot)
        slot.restarts += 1
        engine = self._join(slot, *self._launch(slot))
        if self.closed:
            engine.stop()
            raise RuntimeError("the fleet closed while the engine restarted")
        slot.engine = engine  # type: ignore[assignment]
        return engine

    def nodes(self) -> list[str]:
        """The node of each running engine."""
        engines: list[Any] = self.engines
        return [engine.node for engine in engines]

    def all_see(self, path: Path) -> bool:
        """Whether every running engine's node sees `path` (a shared file system)."""
        ray = require_ray()
        engines: list[Any] = self.engines
        return all(ray.get([engine.actor.sees.remote(str(path)) for engine in engines]))


def check_transport(transport: str, processes: EngineProcesses | None, run_dir: Path) -> None:
    """Refuse a weight transport that cannot reach engines placed by Ray where they are:
    colocated (shared memory, CUDA IPC) works within a node only, and disk needs the run
    directory on a file system every engine's node shares."""
    if not isinstance(processes, RayEngineProcesses):
        return
    here = require_ray().get_runtime_context().get_node_id()
    if transport == "colocated" and any(node != here for node in processes.nodes()):
        raise ValueError(
            f"sync.transport=colocated: Ray placed engines on nodes {processes.nodes()} and "
            f"the trainer on {here}; shared memory and CUDA IPC work within one node only: use "
            "sync.transport=broadcast or disk, or pin engines to the trainer's node "
            "(placement.ray_engine_resources)"
        )
    if transport == "disk" and not processes.all_see(run_dir):
        raise ValueError(
            f"sync.transport=disk: the run directory {run_dir} is not visible on every "
            "engine's node; put it on a file system all nodes share (--run-dir)"
        )


def master_address(processes: EngineProcesses | None) -> str:
    """Where the trainer hosts the broadcast group: its node's address under Ray (engines on
    other nodes join it), else loopback."""
    if not isinstance(processes, RayEngineProcesses):
        return "127.0.0.1"
    return require_ray().util.get_node_ip_address()
