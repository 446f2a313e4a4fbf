"""`verst train` with `placement.backend: ray`: the trainer ranks run as Ray actors, one per
trainer bundle of the run's placement group (`verst.fleet.ray_cluster`).

This process (the driver) joins the cluster or starts a local one, places the bundles, and
runs each attempt of the run as `placement.trainer_ranks` actors, each of which runs
`verst train` as its child with the torch.distributed variables of its rank (rank 0's node and
a free port there as the master), so the ranks form one process group across nodes (gloo on
the CPU, NCCL on GPUs). Rank 0 finds the placement group through its environment and places
the engines in the engine bundles. An attempt ends when every rank has exited, or when one
crashes (the others are killed: they would wait on it forever); a crashed attempt restarts
from the last checkpoint under `--max-restarts`, as `verst.supervisor` restarts a local one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from verst.fleet.placement import PlacementConfig
from verst.fleet.ray_cluster import (
    PLACEMENT_GROUP_ENV,
    bundle_nodes,
    connect,
    place,
    require_ray,
    scheduling,
)
from verst.rundir import append_record
from verst.supervisor import Supervisor

PR_SET_PDEATHSIG = 1
PLACEMENT_FILE = "placement.jsonl"


def _die_with_parent() -> None:
    """In the rank's child: SIGKILL when the actor dies (Linux), so no trainer outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class TrainerRank:
    """The Ray actor of one trainer rank: owns its `verst train` process."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it (rank 0's are the group's master)."""
        import ray

        from verst.fleet.launcher import free_port

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def run(self, command: list[str], env: dict[str, str]) -> int:
        self.process = subprocess.Popen(
            command, env={**os.environ, **env}, preexec_fn=_die_with_parent
        )
        return self.process.wait()

    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def send_signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)


class RayRanks:
    """One attempt's trainer ranks, which the supervisor waits on and signals as it does a
    local child process."""

    def __init__(self, group: Any, name: str, cfg: PlacementConfig, command: list[str]) -> None:
        ray = require_ray()
        self.actors = []
        for rank in range(cfg.trainer_ranks):
            bundle = group.bundle_specs[rank]
            actor_cls = ray.remote(TrainerRank).options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                max_concurrency=4,  # run() blocks; signals and pids come meanwhile
                scheduling_strategy=scheduling(group, rank),
            )
            self.actors.append(actor_cls.remote())
        master, port = ray.get(self.actors[0].address.remote())
        common = {
            "WORLD_SIZE": str(cfg.trainer_ranks),
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "LOCAL_RANK": "0",  # each rank sees its bundle's GPU only, as cuda:0
            "LOCAL_WORLD_SIZE": "1",
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            PLACEMENT_GROUP_ENV: name,
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        }
        self.runs = [
            actor.run.remote(command, {**common, "RANK": str(rank)})
            for rank, actor in enumerate(self.actors)
        ]

    def wait(self) -> int:
        """The first failing rank's exit code, or 0 once every rank has exited with 0."""
        ray = require_ray()
        pending = list(self.runs)
        code = 0
        while pending and code == 0:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                code = ray.get(done[0])
            except ray.exceptions.RayActorError:
                code = -signal.SIGKILL  # the rank's actor itself died
        self.close()
        return code

    def send_signal(self, signum: int) -> None:
        for actor in self.actors:
            actor.send_signal.remote(signum)

    def close(self) -> None:
        ray = require_ray()
        for actor in self.actors:
            ray.kill(actor)  # its child gets SIGKILL with it (PR_SET_PDEATHSIG)


class RaySupervisor(Supervisor):
    """`Supervisor` whose attempts are trainer ranks placed by Ray."""

    def __init__(
        self, train_args: list[str], run_dir: Path, max_restarts: int, cfg: PlacementConfig
    ) -> None:
        super().__init__(train_args, run_dir, max_restarts)
        self.cfg = cfg
        self.group_name = f"verst-{uuid.uuid4().hex[:12]}"
        self.group = place(cfg, self.group_name)
        self._record_placement()

    def _record_placement(self) -> None:
        """`run_dir/placement.jsonl`: where Ray put each trainer rank and engine."""
        nodes = bundle_nodes(self.group)
        record = {
            "time": time.time(),
            "placement_group": self.group_name,
            "bundles": self.group.bundle_specs,
            "trainer_nodes": nodes[: self.cfg.trainer_ranks],
            "engine_nodes": nodes[self.cfg.trainer_ranks :],
        }
        append_record(self.run_dir / PLACEMENT_FILE, record)

    def _attempt(self, resume: bool) -> int:
        command = [sys.executable, "-m", "verst", "train", *self.train_args]
        ranks = RayRanks(self.group, self.group_name, self.cfg, command + ["--resume"] * resume)
        self.process = ranks  # type: ignore[assignment]
        if self.stop_signal is not None:
            ranks.send_signal(self.stop_signal)
        return ranks.wait()


def train_on_ray(
    cfg: PlacementConfig, train_args: list[str], run_dir: Path, max_restarts: int, resume: bool
) -> int:
    """Join (or start) the cluster, place the run, and train to the end; the exit status."""
    cluster = connect(cfg)
    try:
        print(
            f"verst: Ray cluster at {cluster.address} ready in {cluster.start_s:.1f} s; placing "
            f"{cfg.trainer_ranks} trainer rank(s) and {cfg.num_engines} engine(s)",
            file=sys.stderr,
            flush=True,
        )
        return RaySupervisor(train_args, run_dir, max_restarts, cfg).run(resume=resume)
    finally:
        cluster.shutdown()
