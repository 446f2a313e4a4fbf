"""Where a run's rollout engines go: the `placement` section of the config and the device rule
of engine processes."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from verst.configbase import ConfigBase

EngineKind = Literal["embedded", "in_process", "processes"]


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
    max_batch_size: int = Field(256, ge=1, description="most running requests per engine")
    startup_timeout_s: float = Field(
        300.0, gt=0, description="seconds an engine process may take to become healthy"
    )

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
