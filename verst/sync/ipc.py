"""Colocated weight sync across processes: tensors travel as handles, never as bytes.

The trainer and a `verst serve` engine (or an SGLang server) run as separate processes on one
host. `IpcBucketSender` stages each bucket of full tensors in a buffer the engine can map (CUDA
memory, or CPU shared memory in /dev/shm) and sends only a handle to it through SGLang's
`POST /update_weights_from_tensor`; the engine maps the buffer and copies the bytes into its
parameters in place, then answers. Nothing is copied through a socket or a disk. The `colocated`
transport (`verst.sync.colocated.ColocatedTransport`) sends to engine processes through it.

The wire format and the engine's side (unpickling through an allow-list, checks, the copy's
end) are in `verst.sync.shared_tensors`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from verst.plugins import AdapterUpdate
from verst.sync.buckets import adapter_fields, bucket_limit
from verst.sync.shared_tensors import (
    LOAD_FORMATS,
    FlattenedTensorMetadata,
    SharedTensorError,
    bucket_views,
    dumps,
)

ALIGN_BYTES = 256  # every tensor of a bucket starts on this boundary (any dtype can view it)


@dataclass
class _Item:
    name: str
    tensor: torch.Tensor  # a plain tensor or an FSDP2 DTensor (gathered when staged)
    start: int
    nbytes: int
    dtype: torch.dtype


def _align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def plan_shared_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[_Item]]:
    """Consecutive tensors laid out in buckets of at most `bucket_bytes` (each tensor aligned to
    `ALIGN_BYTES`; a larger tensor travels alone). Only shapes are read: a DTensor is not
    gathered here."""
    bucket: list[_Item] = []
    end = 0
    for name, tensor in named:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * cast.itemsize
        start = _align(end)
        if bucket and start + nbytes > bucket_bytes:
            yield bucket
            bucket, start = [], 0
        bucket.append(_Item(name, tensor, start, nbytes, cast))
        end = start + nbytes
    if bucket:
        yield bucket


def _device_of(tensor: torch.Tensor) -> torch.device:
    return tensor.to_local().device if isinstance(tensor, DTensor) else tensor.device


class IpcBucketSender:
    """The trainer's side of colocated sync across processes (CUDA IPC on a GPU, shared memory
    on the CPU). Its `send` has the `WeightTransport` signature, so `WeightSync` can drive it
    alone; `ColocatedTransport` uses it for engine processes.

    `send` walks the named tensors once, in buckets of at most `bucket_bytes`: each tensor
    (an FSDP2 DTensor is gathered with `full_tensor()`, one at a time) is copied, cast to
    `dtype` if given, into one of `num_buffers` staging buffers on the tensors' device, and a
    handle to the bucket goes to every engine through `/update_weights_from_tensor`. While the
    engines copy bucket k the next bucket is staged in the other buffer; a buffer is written
    again only after every engine has answered for it. With `reuse_buffers` (the default) the
    buffers persist across updates, so engines map them once and later updates open nothing.

    Every engine must be on the trainer's host, and for CUDA on the trainer's GPU; an engine
    that is not answers 400 and `send` raises `SharedTensorError` with its message. Under FSDP
    call `send` on every rank (gathering is a collective), each with the engines on its own GPU
    (possibly none). `close()` frees the buffers.
    """

    def __init__(
        self,
        *,
        bucket_bytes: int = 512 << 20,
        load_format: str | None = "flattened_bucket",
        dtype: torch.dtype | None = None,
        num_buffers: int = 2,
        reuse_buffers: bool = True,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        self.bucket_bytes = bucket_bytes
        self.load_format = load_format
        self.dtype = dtype
        self.num_buffers = num_buffers
        self.reuse_buffers = reuse_buffers
        self.buckets_sent: list[int] = []  # bytes of each bucket of the last send (padding in)
        # seconds per bucket of the last send: "stage" (gather + copy + pickle, trainer side),
        # "engines" (until every engine has answered for the bucket)
        self.timings: dict[str, list[float]] = {"stage": [], "engines": []}
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._executor: ThreadPoolExecutor | None = None

    async def send(
        self,
        engines: list[Any],
        tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        version: int,
        adapter: AdapterUpdate | None = None,
    ) -> None:
        if self._executor is None:
            # One thread stages every bucket: gathers stay in order, and the event loop keeps
            # answering the engines while a bucket is copied.
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="verst-shared-tensors")
        loop = asyncio.get_running_loop()
        in_flight: list[asyncio.Future[None] | None] = [None] * self.num_buffers
        self.buckets_sent = []
        self.timings = {"stage": [], "engines": []}
        try:
            for index, bucket in enumerate(
                plan_shared_buckets(tensors(), bucket_limit(self.bucket_bytes, adapter), self.dtype)
            ):
                slot = index % self.num_buffers
                if in_flight[slot] is not None:
                    await in_flight[slot]  # every engine is done with this buffer
                    in_flight[slot] = None
                bodies = await loop.run_in_executor(
                    self._executor, self._stage, slot, bucket, len(engines)
                )
                bodies = [{**body, **adapter_fields(adapter)} for body in bodies]
                in_flight[slot] = asyncio.ensure_future(self._post(engines, bodies))
                self.buckets_sent.append(bucket[-1].start + bucket[-1].nbytes)
        finally:
            # Never return (or raise) while an engine may still read a buffer.
            pending = [f for f in in_flight if f is not None]
            results = await asyncio.gather(*pending, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        if not self.reuse_buffers:
            self._buffers = [None] * self.num_buffers

    def _buffer(self, slot: int, size: int, device: torch.device) -> torch.Tensor:
        buffer = self._buffers[slot]
        if buffer is None or buffer.device != device or buffer.numel() < size:
            grown = (
                size if buffer is None else max(size, min(2 * buffer.numel(), self.bucket_bytes))
            )
            nbytes = _align(max(grown, 1))
            if device.type == "cpu":  # a file in /dev/shm from the start (file_system strategy)
                storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
                buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
            else:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._buffers[slot] = buffer
        return buffer

    def _stage(self, slot: int, bucket: list[_Item], copies: int) -> list[dict[str, Any]]:
        """Gather and copy `bucket` into buffer `slot`; one request body per engine (each pickle
        takes its own reference on the shared memory, which that engine's unpickling drops)."""
        started = time.perf_counter()
        device = _device_of(bucket[0].tensor)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this worker thread's device, for gathers and copies
        size = bucket[-1].start + bucket[-1].nbytes
        buffer = self._buffer(slot, size, device)
        targets = bucket_views(buffer, [(i.start, i.dtype, tuple(i.tensor.shape)) for i in bucket])
        batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for item, target in zip(bucket, targets, strict=True):
            if isinstance(item.tensor, DTensor):
                target.copy_(item.tensor.detach().full_tensor())  # gathered one at a time
            else:
                batch[0].append(target)
                batch[1].append(item.tensor.detach())
        if batch[0]:
            torch._foreach_copy_(*batch)  # one call for the bucket's plain tensors
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()
        flat = buffer[:size]
        bodies = [self._body(flat, bucket) for _ in range(copies)]
        self.timings["stage"].append(time.perf_counter() - started)
        return bodies

    def _body(self, flat: torch.Tensor, bucket: list[_Item]) -> dict[str, Any]:
        if self.load_format == "flattened_bucket":
            metadata = [
                FlattenedTensorMetadata(
                    name=item.name,
                    shape=torch.Size(item.tensor.shape),
                    dtype=item.dtype,
                    start_idx=item.start,
                    end_idx=item.start + item.nbytes,
                    numel=item.nbytes,
                )
                for item in bucket
            ]
            payload = dumps({"flattened_tensor": flat, "metadata": metadata})
        else:
            layout = [(item.start, item.dtype, tuple(item.tensor.shape)) for item in bucket]
            views = [(i.name, v) for i, v in zip(bucket, bucket_views(flat, layout), strict=True)]
            payload = dumps(views)
        return {
            "serialized_named_tensors": [payload],
            "load_format": self.load_format,
            "flush_cache": True,
        }

    async def _post(self, engines: list[Any], bodies: list[dict[str, Any]]) -> None:
        from verst.fleet.client import EngineError

        async def one(index: int, engine: Any, body: dict[str, Any]) -> None:
            try:
                await engine.update_weights_from_tensor(body)
            except EngineError as error:
                message = error.body.get("message") if isinstance(error.body, dict) else None
                raise SharedTensorError(
                    f"engine {index} refused the shared-tensor update ({error.status}): "
                    f"{message or error.body}"
                ) from error

        started = time.perf_counter()
        await asyncio.gather(
            *(one(i, e, b) for i, (e, b) in enumerate(zip(engines, bodies, strict=True)))
        )
        self.timings["engines"].append(time.perf_counter() - started)

    def close(self) -> None:
        """Free the staging buffers (engines let go of their mappings as newer ones arrive)."""
        self._buffers = [None] * self.num_buffers
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
