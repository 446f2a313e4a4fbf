"""Where a run's rollout engines go: the `placement` section of the config and the device rule
of engine processes."""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch
from pydantic import Field, model_validator

from verst.configbase import ConfigBase

EngineKind = Literal["embedded", "in_process", "processes"]


class RayNodeConfig(ConfigBase):
    num_cpus: int = Field(1, ge=1, description="CPUs this local Ray node offers (whole CPUs)")
    num_gpus: int = Field(0, ge=0, description="GPUs this local Ray node offers")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom resources of this node (e.g. {verst_engine: 1}) that bundles ask for",
    )


class PlacementConfig(ConfigBase):
    engines: EngineKind = Field(
        "embedded",
        description="rollout engines: embedded = the scheduler called in the trainer's thread; "
        "in_process = "
        "serving engines (continuous batching) in the trainer's process; processes = `verst "
        "serve` subprocesses",
    )
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="colocated = engines share the trainer's device; disaggregated = engine "
        "processes on devices of their own (needed by fully_async)",
    )
    num_engines: int = Field(1, ge=1, description="serving engines (in_process or processes)")
    engine_devices: list[str] = Field(
        default_factory=list,
        description="device of each engine process (cycled); empty = the trainer's device when "
        "colocated, else the GPUs after the trainer's (or the CPU)",
    )
    engine_threads: int | None = Field(
        None, ge=1, description="torch CPU threads per engine process; unset = torch's default"
    )
    engine_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="CPU scheduling niceness of the engine processes; 0 = the trainer's, "
        "higher = they yield the CPU to it",
    )
    sleep_engines: bool = Field(
        False,
        description="the embedded engine gives its KV cache, CUDA graphs and weights' device "
        "memory back while the trainer trains (colocated on one GPU)",
    )
    max_batch_size: int = Field(256, ge=1, description="most running requests per engine")
    startup_timeout_s: float = Field(
        300.0, gt=0, description="seconds an engine process may take to become healthy"
    )

    backend: Literal["local", "ray"] = Field(
        "local",
        description="local = engine and trainer processes on this machine; ray = Ray actors "
        "placed by a placement group on a Ray cluster (pip install 'verst[ray]')",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join (ray.init address, e.g. 10.0.0.1:6379); unset = "
        "$RAY_ADDRESS, else a local cluster of placement.ray_local_nodes",
    )
    ray_connect_timeout_s: float = Field(
        10.0, gt=0, description="seconds the Ray cluster's address may take to accept a connection"
    )
    ray_local_nodes: list[RayNodeConfig] = Field(
        default_factory=list,
        description="nodes of the local Ray cluster verst starts when it joins none; empty = "
        "one node with this machine's CPUs and GPUs",
    )
    ray_object_store_mb: int = Field(
        100, ge=75, description="object store of each local Ray node verst starts, in MiB"
    )
    trainer_ranks: int = Field(
        1, ge=1, description="trainer ranks under the ray backend, one bundle each"
    )
    ray_trainer_cpus: float = Field(1.0, gt=0, description="CPUs in each trainer rank's bundle")
    ray_engine_cpus: float = Field(1.0, gt=0, description="CPUs in each engine's bundle")
    ray_trainer_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs in each trainer rank's bundle (a fraction < 1 shares a GPU, e.g. 0.5 "
        "with an engine of 0.5); null = 1 on a GPU cluster, else 0",
    )
    ray_engine_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs in each engine's bundle (a fraction < 1 shares a GPU); null = 1 on a "
        "GPU cluster, else 0",
    )
    ray_trainer_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom resources each trainer rank's bundle asks for (pins ranks to nodes "
        "that offer them)",
    )
    ray_engine_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom resources each engine's bundle asks for (pins engines to nodes "
        "that offer them)",
    )
    ray_placement_timeout_s: float = Field(
        60.0, gt=0, description="seconds the placement group may take to be placed"
    )

    @model_validator(mode="after")
    def _check_backend(self) -> PlacementConfig:
        for role in ("trainer", "engine"):
            gpus = getattr(self, f"ray_{role}_gpus")
            if gpus is not None and gpus > 1 and gpus != int(gpus):
                raise ValueError(
                    f"placement.ray_{role}_gpus={gpus}: Ray places a fraction of one GPU or "
                    "whole GPUs, not a fraction above 1"
                )
        if self.backend == "local":
            if self.trainer_ranks != 1:
                raise ValueError(
                    "placement.trainer_ranks > 1 needs placement.backend=ray; with the local "
                    "backend, start the ranks with torchrun"
                )
            return self
        if importlib.util.find_spec("ray") is None:
            raise ValueError(
                "placement.backend=ray needs Ray, which is not installed: pip install "
                "'verst[ray]' (or set placement.backend=local)"
            )
        return self

    @property
    def serving(self) -> bool:
        return self.engines != "embedded"


def engine_devices(cfg: PlacementConfig, trainer_device: torch.device) -> list[str]:
    """One device per engine process, by the rule in `engine_devices`'s description."""
    if cfg.engine_devices:
        return [cfg.engine_devices[i % len(cfg.engine_devices)] for i in range(cfg.num_engines)]
    if cfg.mode == "colocated" or trainer_device.type != "cuda":
        return [str(trainer_device)] * cfg.num_engines
    first = (trainer_device.index or 0) + 1
    available = torch.cuda.device_count()
    if first + cfg.num_engines > available:
        raise RuntimeError(
            f"placement.mode=disaggregated needs {cfg.num_engines} GPU(s) after the trainer's "
            f"{trainer_device}, but this machine has {available}; set placement.engine_devices "
            "explicitly (e.g. [cuda:0] to share the trainer's GPU) or lower num_engines"
        )
    return [f"cuda:{first + i}" for i in range(cfg.num_engines)]
