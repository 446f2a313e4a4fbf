"""The trainer's side of weight sync to a `Fleet` of serving engines, chosen by config.

`FleetSync.push(version)` runs the version protocol (`verst.sync.protocol.WeightSync`) over
every engine of the fleet with the transport `sync.transport` names, one class per value:

- `colocated`: `verst.sync.colocated.ColocatedTransport` (engines on the trainer's device:
  nothing sent to an in-process engine that shares the trainer's storage, an in-process copy to
  another, CUDA IPC or shared-memory handles to an engine process);
- `broadcast`: `verst.sync.broadcast.BroadcastTransport` (a process group of the trainer and
  every engine process, gloo / NCCL, bucketed);
- `disk`: `verst.sync.disk.DiskTransport` (a safetensors snapshot or delta published once,
  loaded by every engine).

The tensors sent are the trainer's full parameters, in the engines' dtype, gathered one at a
time (FSDP2 shards become full tensors tensor by tensor, never the whole model at once). With
LoRA (`model.lora`) they are the adapter's alone, sent as one `AdapterUpdate` that engines hold
under `POLICY_ADAPTER` beside the frozen base they loaded at start.
"""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from verst import distributed
from verst.configbase import ConfigBase
from verst.fleet.fleet import Fleet
from verst.fleet.launcher import free_port
from verst.fleet.placement import PlacementConfig
from verst.fleet.ray_engines import check_transport, master_address
from verst.models.lora import POLICY_ADAPTER, LoraConfig
from verst.plugins import AdapterUpdate, EngineClient, WeightTransport
from verst.sync.broadcast import BroadcastTransport
from verst.sync.buckets import AdapterTensors
from verst.sync.colocated import ColocatedTransport
from verst.sync.disk import DiskPublisher, DiskTransport
from verst.sync.protocol import (
    EveryEngineLost,
    PauseMode,
    PushReport,
    Weights,
    WeightSync,
    WeightSyncError,
)
from verst.train.trainer import Trainer

TransportName = Literal["auto", "colocated", "broadcast", "disk"]


class SyncConfig(ConfigBase):
    transport: TransportName = Field(
        "auto",
        description="how new weights reach the engines: colocated (shared storage / in-process "
        "copy in one process; CUDA IPC or shared memory across processes), broadcast "
        "(torch.distributed group), disk (snapshot or delta); auto = colocated when placement "
        "is colocated, else broadcast",
    )
    bucket_mb: int = Field(512, ge=1, description="largest bucket of weights sent at once, MB")
    disk_mode: Literal["full", "xor", "overwrite"] = Field(
        "xor", description="disk transport: full snapshots, or deltas by XOR or by overwrite"
    )
    max_resends: int = Field(
        1, ge=0, description="resends to an engine that does not report the new version"
    )

    def resolve(self, placement: PlacementConfig) -> str:
        """The transport `auto` stands for, given where the engines run."""
        if self.transport != "auto":
            return self.transport
        return "colocated" if placement.mode == "colocated" else "broadcast"


class FleetSync:
    """Rank 0 runs the protocol over the fleet; under torchrun the other ranks only take part in
    gathering each full tensor (FSDP2 shards), in the same order, once per push."""

    def __init__(
        self,
        trainer: Trainer,
        fleet: Fleet | None,
        *,
        transport: WeightTransport | None,
        pause_mode: PauseMode,
        engine_dtype: torch.dtype,
        generator: Any,
        max_resends: int = 1,
        lora: LoraConfig | None = None,
    ) -> None:
        self.trainer = trainer
        self.lora = lora if trainer.lora else None
        self._adapters: dict[str | None, AdapterTensors] = {}  # the walk of each adapter, once
        self.fleet = fleet
        self.engine_dtype = engine_dtype
        self.transport = transport
        self.generator = generator  # what the rollout generates with; it carries the version
        self.protocol = None
        if fleet is not None and transport is not None:
            ft = fleet.fault_tolerance
            self.protocol = WeightSync(
                fleet.clients,
                transport,
                pause_mode=pause_mode,
                max_resends=max_resends,
                on_engine_lost=fleet.lose_client,
                call_timeout_s=ft.timeout_s if ft is not None else None,
                repeat_send=distributed.world_size() == 1,
            )
            if distributed.world_size() == 1:  # other ranks could not join the gathers
                fleet.rejoin = self.rejoin
        self.last_push: dict[str, float] = {}
        self.sent_bytes = 0  # bytes taken from the trainer for engines (every walk of a push)

    @classmethod
    def build(
        cls,
        cfg: SyncConfig,
        *,
        placement: PlacementConfig,
        pause_mode: PauseMode,
        trainer: Trainer,
        fleet: Fleet | None,
        generator: Any,
        engine_dtype: torch.dtype,
        run_dir: Path,
        lora: LoraConfig | None = None,
    ) -> FleetSync:
        """`fleet` is rank 0's; other ranks pass None and follow. `lora`: the trainer's adapter
        config when it trains LoRA adapters."""
        if fleet is None:
            return cls(
                trainer,
                None,
                transport=None,
                pause_mode=pause_mode,
                engine_dtype=engine_dtype,
                generator=generator,
                lora=lora,
            )
        name = cfg.resolve(placement)
        check_transport(name, fleet.engine_processes, run_dir)
        bucket_bytes = cfg.bucket_mb << 20
        transport: WeightTransport
        if name == "colocated":
            transport = ColocatedTransport.sharing_storage(
                trainer, fleet.clients, bucket_bytes=bucket_bytes, dtype=engine_dtype
            )
        elif name == "broadcast":
            on_cuda = trainer.device.type == "cuda"
            if on_cuda and _same_device(trainer.device, fleet.process_devices):
                raise ValueError(
                    f"sync.transport=broadcast: an engine process shares the trainer's GPU "
                    f"{trainer.device}, and NCCL cannot join two ranks on one GPU; give the "
                    "engines other GPUs (placement.engine_devices) or use sync.transport="
                    "colocated (CUDA IPC) or disk"
                )
            ft = fleet.fault_tolerance
            address = master_address(fleet.engine_processes)
            transport = BroadcastTransport(
                master_port=free_port(address),
                master_address=address,
                bucket_bytes=bucket_bytes,
                backend="nccl" if on_cuda else "gloo",
                join_timeout_s=ft.timeout_s if ft is not None else 300.0,
            )
            fleet.loop.run(transport.connect(fleet.clients))
        elif name == "disk":
            root = run_dir / "weights"
            # versions an earlier process of this run published (before a resume) fed engines
            # that are gone, and would collide with the versions this process publishes
            shutil.rmtree(root, ignore_errors=True)
            publisher = DiskPublisher(root, mode=cfg.disk_mode)
            transport = DiskTransport(publisher)
        else:
            raise ValueError(f"unknown sync.transport {name!r}")
        # A resend gathers the tensors again, which other ranks would not join: report instead.
        max_resends = cfg.max_resends if distributed.world_size() == 1 else 0
        return cls(
            trainer,
            fleet,
            transport=transport,
            pause_mode=pause_mode,
            engine_dtype=engine_dtype,
            generator=generator,
            max_resends=max_resends,
            lora=lora,
        )

    def tensors(self, adapter: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's full parameters in the engines' dtype, one tensor at a time; with LoRA
        its adapter's (`adapter`'s, with multi-LoRA), named as engines take them."""
        if self.lora is None:
            named = self.trainer.full_parameters(self.engine_dtype)
        else:
            if adapter not in self._adapters:
                trainable = self.trainer.trainable_parameters
                self._adapters[adapter] = AdapterTensors(trainable, self.engine_dtype, adapter)
            named = self._adapters[adapter]()
        for name, tensor in named:
            self.sent_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def weights(self, *, every_adapter: bool = False) -> Weights:
        """What a push installs: the whole model, or (LoRA) the adapter; with multi-LoRA the
        adapters the last step trained (`every_adapter`: all of them, for engines that hold
        none yet; before the first step, and in a world of several ranks, always all)."""
        if self.lora is None:
            return self.tensors
        if not self.lora.adapters:
            return [AdapterUpdate(POLICY_ADAPTER, self.lora.wire_config(), self.tensors)]
        names = self.trainer.stepped_adapters
        if every_adapter or not names or distributed.world_size() > 1:
            names = self.lora.names
        config = self.lora.wire_config()
        return [AdapterUpdate(n, config, functools.partial(self.tensors, n)) for n in names]

    def close(self) -> None:
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    def push(self, version: int) -> dict[str, float]:
        """Install the trainer's weights as `version` on every engine; returns sync metrics."""
        if self.fleet is None:  # another rank: join each tensor's gather, send nothing
            weights = self.weights()
            for tensors in [weights] if callable(weights) else [a.tensors for a in weights]:
                for _ in tensors():
                    pass
            self.generator.weight_version = version
            return {}
        return self.fleet.loop.run(self.apush(version))

    async def apush(self, version: int) -> dict[str, float]:
        """`push`, for coroutines on the fleet's loop (the fully asynchronous loop): every
        serving engine and every restarted engine waiting to join gets `version`."""
        assert self.fleet is not None
        started = time.perf_counter()
        self.sent_bytes = 0
        joining = list(self.fleet.joining_engines().values())
        report = await self._push(self.fleet.clients + joining, version, bool(joining))
        self.generator.weight_version = version
        self.last_push = {
            "sync/update_s": time.perf_counter() - started,
            "sync/resent_engines": float(len(report.resent)),
            "sync/live_engines": float(len(report.engines)),
            "sync/lost_engines": float(len(report.lost)),
            "sync/bytes": float(self.sent_bytes),
        } | {f"perf/sync_{step}_time_s": s for step, s in report.step_seconds.items()}
        return self.last_push

    def rejoin(self) -> None:
        """The current weights for restarted engines only, so they serve before the next
        step's push (the trainer's thread calls it while it waits on the fleet)."""
        assert self.fleet is not None
        joining = list(self.fleet.joining_engines().values())
        if joining:
            self.fleet.loop.run(self._push(joining, self.fleet.weight_version, True))

    async def _push(
        self, engines: list[EngineClient], version: int, every_adapter: bool = False
    ) -> PushReport:
        assert self.protocol is not None and self.fleet is not None
        fleet = self.fleet
        fleet.raise_failure()
        if not engines and fleet.recovering:  # every live engine died while others restart
            engines, every_adapter = await fleet.restarted_engines(), True
        if not engines:
            raise WeightSyncError(
                "every engine is down and none is restarting: no engine left to update"
            )
        fleet.begin_push()
        pushed: int | None = None
        try:
            while True:
                try:
                    weights = self.weights(every_adapter=every_adapter)
                    report = await self.protocol.push(weights, version, engines)
                    break
                except EveryEngineLost:
                    if not fleet.recovering or not self.protocol.repeat_send:
                        raise
                    engines = await fleet.restarted_engines()  # they take this push instead
            pushed = version
        finally:
            fleet.end_push(pushed)
        fleet.admit(report.engines)
        return report


def _same_device(device: torch.device, others: list[str]) -> bool:
    index = device.index or 0
    return any(
        torch.device(o).type == device.type and (torch.device(o).index or 0) == index
        for o in others
    )
