"""The `colocated` transport: engines on the trainer's device, reached without a socket or a
disk carrying the bytes.

`ColocatedTransport` serves every kind of serving engine the placement can put there:
- an engine in the trainer's process whose parameters ARE the trainer's tensors (re-pointed by
  `share_storage`: a world of one, same dtype) needs nothing sent: the optimiser wrote them;
- another engine in the trainer's process gets an in-process copy, bucket by bucket;
- an engine process on the trainer's device gets CUDA IPC handles (GPU) or shared-memory buffers
  (CPU) and copies from them (`verst.sync.ipc.IpcBucketSender`); a `verst serve` process gets
  the whole update (pause to continue) in one request (`WholeUpdates`), an SGLang server
  SGLang's calls.

The embedded engine shares storage the same way, without the version protocol
(`verst.sync.embedded`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import torch

from verst import distributed
from verst.fleet.client import InProcessEngineClient
from verst.plugins import AdapterUpdate, EngineClient, NamedTensors
from verst.sync.buckets import adapter_fields, bucket_limit, bucketed
from verst.sync.ipc import IpcBucketSender
from verst.train.trainer import Trainer


def share_storage(trainer: Trainer, model: torch.nn.Module) -> bool:
    """Re-point `model`'s parameters at the trainer's storage when a rank holds whole
    parameters (a world of one) with the same names, shapes, dtypes and device; else False."""
    if distributed.world_size() != 1:
        return False
    engine_params = dict(model.named_parameters())
    local = dict(trainer.named_local_parameters())
    if engine_params.keys() != local.keys():
        return False
    for name, tensor in local.items():
        target = engine_params[name]
        if (target.shape, target.dtype, target.device) != (
            tensor.shape,
            tensor.dtype,
            tensor.device,
        ):
            return False
    for name, tensor in local.items():
        engine_params[name].data = tensor
    return True


class ColocatedTransport:
    """The `colocated` transport, for `WeightSync`. An engine that takes tensors in-process
    (`update_weights_from_tensors`, as `InProcessEngineClient` does) gets a copy unless it is
    one of `shared`; any other engine is an engine process on the trainer's device and gets
    handles to staging buffers (`IpcBucketSender`, configured by `bucket_bytes` and `dtype`).

    A fleet's engines are all of one kind, so a push walks the tensors once (under FSDP each
    walk is a collective gather that every rank joins).
    """

    def __init__(
        self,
        *,
        bucket_bytes: int = 512 << 20,
        dtype: torch.dtype | None = None,
        shared: Iterable[EngineClient] = (),
        whole_updates: bool = True,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.shared = {id(e) for e in shared}  # engines whose weights are the trainer's tensors
        self.ipc = IpcBucketSender(
            bucket_bytes=bucket_bytes, dtype=dtype, whole_updates=whole_updates
        )

    @classmethod
    def sharing_storage(
        cls,
        trainer: Trainer,
        engines: Iterable[EngineClient],
        *,
        bucket_bytes: int = 512 << 20,
        dtype: torch.dtype | None = None,
    ) -> ColocatedTransport:
        """Re-point each in-process engine's parameters at the trainer's storage where
        `share_storage` can; those engines are then sent nothing."""
        shared = [
            e
            for e in engines
            if isinstance(e, InProcessEngineClient)
            and share_storage(trainer, e.serving.scheduler.model)
        ]
        return cls(bucket_bytes=bucket_bytes, dtype=dtype, shared=shared)

    async def send(
        self,
        engines: list[EngineClient],
        tensors: NamedTensors,
        version: int,
        adapter: AdapterUpdate | None = None,
    ) -> None:
        copied, processes = [], []
        for engine in engines:
            if not hasattr(engine, "update_weights_from_tensors"):
                processes.append(engine)
            elif id(engine) not in self.shared:
                copied.append(engine)
        if copied:  # every engine from one pass over the tensors
            fields = adapter_fields(adapter)
            for bucket in bucketed(tensors(), bucket_limit(self.bucket_bytes, adapter)):
                await asyncio.gather(
                    *(e.update_weights_from_tensors(bucket, **fields) for e in copied)
                )
        if processes:
            await self.ipc.send(processes, tensors, version, adapter)

    async def whole_update_engines(self, engines: list[EngineClient]) -> list[EngineClient]:
        """The engine processes that take the whole update in one request (`verst serve`)."""
        processes = [e for e in engines if not hasattr(e, "update_weights_from_tensors")]
        return await self.ipc.whole_update_engines(processes)

    async def update_whole(
        self,
        engines: list[EngineClient],
        tensors: NamedTensors,
        version: int,
        pause_mode: str,
        timeout_s: float | None = None,
    ) -> dict[EngineClient, BaseException | None]:
        """`IpcBucketSender.update_whole`: the whole protocol in one request per engine."""
        return await self.ipc.update_whole(engines, tensors, version, pause_mode, timeout_s)

    def close(self) -> None:
        """Free the staging buffers of engine processes."""
        self.ipc.close()
