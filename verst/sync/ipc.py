"""Colocated weight sync across processes: tensors travel as handles, never as bytes.

The trainer and a `verst serve` engine (or an SGLang server) run as separate processes on one
host. `IpcBucketSender` stages each bucket of full tensors in a buffer the engine can map (CUDA
memory, or CPU shared memory in /dev/shm) and sends only a handle to it through SGLang's
`POST /update_weights_from_tensor`; the engine maps the buffer and copies the bytes into its
parameters in place, then answers. A `verst serve` engine gets verst's own request instead, the
whole update in one round trip (`verst.sync.buffer_layouts`). Nothing is copied through a socket
or a disk. The `colocated` transport (`verst.sync.colocated.ColocatedTransport`) sends to engine
processes through it.

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
from weakref import WeakKeyDictionary

import torch
from torch.distributed.tensor import DTensor

from verst.plugins import AdapterUpdate
from verst.sync.buckets import adapter_fields, bucket_limit
from verst.sync.buffer_layouts import UNKNOWN_LAYOUT_STATUS, new_layout_id
from verst.sync.protocol import takes_whole_updates
from verst.sync.shared_tensors import (
    LOAD_FORMATS,
    FlattenedTensorMetadata,
    SharedTensorError,
    bucket_views,
    dumps,
)

ALIGN_BYTES = 256  # every tensor of a bucket starts on this boundary (any dtype can view it)
HELD_VIEWS = 64  # layouts whose views into a buffer are kept (a push's buckets per buffer)


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
    for bucket, _ in _planned(named, bucket_bytes, dtype):
        yield bucket


def _planned(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None
) -> Iterator[tuple[list[_Item], bool]]:
    """`plan_shared_buckets`, each bucket with whether it is the last (known without taking
    more tensors from `named` than the bucket's own and the next one)."""
    bucket: list[_Item] = []
    end = 0
    for name, tensor in named:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * cast.itemsize
        start = _align(end)
        if bucket and start + nbytes > bucket_bytes:
            yield bucket, False
            bucket, start = [], 0
        bucket.append(_Item(name, tensor, start, nbytes, cast))
        end = start + nbytes
    if bucket:
        yield bucket, True


def _device_of(tensor: torch.Tensor) -> torch.device:
    return tensor.to_local().device if isinstance(tensor, DTensor) else tensor.device


def _signature(bucket: list[_Item]) -> tuple[Any, ...]:
    """What places a bucket's tensors in its buffer: names, dtypes, shapes, offsets."""
    return tuple((i.name, i.dtype, tuple(i.tensor.shape), i.start) for i in bucket)


@dataclass
class _Staged:
    """A bucket in its staging buffer, for verst's whole-update request."""

    slot: int
    layout: str  # the id of the buffer's layout (`verst.sync.buffer_layouts`)
    flat: torch.Tensor
    bucket: list[_Item]


def _whole_body(staged: list[_Staged], known: set[str], fields: dict[str, Any]) -> dict[str, Any]:
    """A whole-update body: each buffer by its layout id, with the payload (pickled for this
    engine alone: each pickle takes its own reference) where the engine does not hold it."""
    buffers = [
        {"layout": s.layout}
        if s.layout in known
        else {"layout": s.layout, "payload": _flattened_payload(s.flat, s.bucket)}
        for s in staged
    ]
    return {"buffers": buffers, **fields}


def _refusal(index: int, error: Any) -> SharedTensorError:
    message = error.body.get("message") if isinstance(error.body, dict) else None
    return SharedTensorError(
        f"engine {index} refused the shared-tensor update ({error.status}): {message or error.body}"
    )


def _flattened_payload(flat: torch.Tensor, bucket: list[_Item]) -> str:
    """SGLang's flattened bucket: the buffer's handle and each tensor's place in it."""
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
    return dumps({"flattened_tensor": flat, "metadata": metadata})


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

    A `verst serve` engine (`whole_update_engines`) is updated through `update_whole` instead:
    the version protocol's six calls and every bucket in one request when the buckets fit the
    buffers, each buffer's layout sent once (`verst.sync.buffer_layouts`); `whole_updates=False`
    keeps SGLang's calls for every engine (what an SGLang server always gets).

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
        whole_updates: bool = True,
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
        # seconds of the last send or update_whole: "stage" per staging call (gather + copy, and
        # the pickle in `send`, trainer side; the buckets of a one-request update are staged in
        # one call), "engines" per request (until every engine answered)
        self.timings: dict[str, list[float]] = {"stage": [], "engines": []}
        self.whole_updates = whole_updates
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        # the layout ids each buffer has held, by their tensors' (name, dtype, shape, start)
        self._layouts: list[dict[tuple[Any, ...], str]] = [{} for _ in range(num_buffers)]
        self._dead_layouts: set[str] = set()  # of buffers since freed: engines may let them go
        self._views: list[dict[tuple[Any, ...], list[torch.Tensor]]] = [
            {} for _ in range(num_buffers)
        ]  # the same layouts' views into each buffer (`_targets`)
        self._known: WeakKeyDictionary[Any, set[str]] = WeakKeyDictionary()  # ids each engine holds
        self._timeout_s: float | None = None  # of a whole-update request (`update_whole`)
        self._executor: ThreadPoolExecutor | None = None

    async def send(
        self,
        engines: list[Any],
        tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        version: int,
        adapter: AdapterUpdate | None = None,
    ) -> None:
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
                    self._stager(), self._stage, slot, bucket, len(engines)
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

    def _stager(self) -> ThreadPoolExecutor:
        if self._executor is None:
            # One thread stages every bucket: gathers stay in order, and the event loop keeps
            # answering the engines while a bucket is copied.
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="verst-shared-tensors")
        return self._executor

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
            self._forget_layouts(slot)  # another buffer: engines must open it
        return buffer

    def _stage(self, slot: int, bucket: list[_Item], copies: int) -> list[dict[str, Any]]:
        """Gather and copy `bucket` into buffer `slot`; one request body per engine (each pickle
        takes its own reference on the shared memory, which that engine's unpickling drops)."""
        started = time.perf_counter()
        flat = self._fill(slot, bucket)
        bodies = [self._body(flat, bucket) for _ in range(copies)]
        self.timings["stage"].append(time.perf_counter() - started)
        return bodies

    def _fill_all(self, buckets: list[tuple[int, list[_Item]]]) -> list[torch.Tensor]:
        """`_fill` for each `(slot, bucket)`, waiting for the device once, after the last."""
        return [
            self._fill(slot, b, sync=i == len(buckets) - 1) for i, (slot, b) in enumerate(buckets)
        ]

    def _fill(self, slot: int, bucket: list[_Item], sync: bool = True) -> torch.Tensor:
        """Gather and copy `bucket` into buffer `slot`; its filled bytes, once on the device
        (not yet, without `sync`: the copies are queued on the current stream)."""
        device = _device_of(bucket[0].tensor)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this worker thread's device, for gathers and copies
        size = bucket[-1].start + bucket[-1].nbytes
        buffer = self._buffer(slot, size, device)
        targets = self._targets(slot, buffer, bucket)
        batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for item, target in zip(bucket, targets, strict=True):
            if isinstance(item.tensor, DTensor):
                target.copy_(item.tensor.detach().full_tensor())  # gathered one at a time
            else:
                batch[0].append(target)
                batch[1].append(item.tensor.detach())
        if batch[0]:
            torch._foreach_copy_(*batch)  # one call for the bucket's plain tensors
        if sync and buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()
        return buffer[:size]

    def _targets(self, slot: int, buffer: torch.Tensor, bucket: list[_Item]) -> list[torch.Tensor]:
        """Each tensor's place in buffer `slot`, kept per layout: building the views of a 0.5B
        model's 512 MB bucket (145 tensors) takes 0.5 ms of Python, a lookup 0.05 ms."""
        signature = _signature(bucket)
        views = self._views[slot].get(signature)
        if views is None:
            if len(self._views[slot]) >= HELD_VIEWS:
                self._views[slot].clear()
            layout = [(i.start, i.dtype, tuple(i.tensor.shape)) for i in bucket]
            views = self._views[slot][signature] = bucket_views(buffer, layout)
        return views

    def _body(self, flat: torch.Tensor, bucket: list[_Item]) -> dict[str, Any]:
        if self.load_format == "flattened_bucket":
            payload = _flattened_payload(flat, bucket)
        else:
            layout = [(item.start, item.dtype, tuple(item.tensor.shape)) for item in bucket]
            views = [(i.name, v) for i, v in zip(bucket, bucket_views(flat, layout), strict=True)]
            payload = dumps(views)
        return {
            "serialized_named_tensors": [payload],
            "load_format": self.load_format,
            "flush_cache": True,
        }

    # ---- verst engines: the whole update in one request (`verst.sync.buffer_layouts`) ------

    async def whole_update_engines(self, engines: list[Any]) -> list[Any]:
        """Those of `engines` that take verst's whole-update request (`update_whole`); none
        with `whole_updates` off. An engine that cannot say is left to the stepwise protocol."""
        if not self.whole_updates:
            return []
        answers = await takes_whole_updates(engines)
        return [e for e, ok in zip(engines, answers, strict=True) if ok]

    async def update_whole(
        self,
        engines: list[Any],
        tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        version: int,
        pause_mode: str,
        timeout_s: float | None = None,
    ) -> dict[Any, BaseException | None]:
        """The whole version protocol on `engines` (each from `whole_update_engines`) with the
        weights' handles: when every bucket fits in the `num_buffers` staging buffers, one
        request per engine pauses it in `pause_mode`, flushes its cache (but in place), copies
        every buffer, stamps `version` and continues; with more buckets, a request per bucket
        (the first pauses, the last stamps and continues; the next bucket is staged while the
        engines copy). Each engine's failure, or None where the engine answered `version`; an
        engine that does not answer a request within `timeout_s` has failed (and is sent no
        more: a hung engine is restarted, not waited for)."""
        opening = {"pause_mode": pause_mode, "flush_cache": pause_mode != "in_place"}
        closing = {"weight_version": str(version), "continue_generation": True}
        failures: dict[Any, BaseException | None] = dict.fromkeys(engines)
        self._timeout_s = timeout_s
        self.buckets_sent, self.timings = [], {"stage": [], "engines": []}
        planned = _planned(tensors(), self.bucket_bytes, self.dtype)
        first: list[list[_Item]] = []
        finished = True
        for bucket, last in planned:
            first.append(bucket)
            finished = last
            if last or len(first) == self.num_buffers:
                break
        staged = await self._stage_layouts(list(enumerate(first)))
        if finished:
            await self._part(failures, staged, {**opening, **closing})
        else:
            await self._stream_parts(failures, staged, planned, opening, closing)
        if not self.reuse_buffers:
            self._buffers = [None] * self.num_buffers
            for slot in range(self.num_buffers):
                self._forget_layouts(slot)
        return failures

    async def _stream_parts(
        self,
        failures: dict[Any, BaseException | None],
        staged: list[_Staged],
        planned: Iterator[tuple[list[_Item], bool]],
        opening: dict[str, Any],
        closing: dict[str, Any],
    ) -> None:
        """More buckets than buffers: one request per bucket. The first (the pause) is answered
        before any other is sent, and the last (the version) after every other."""
        await self._part(failures, staged[:1], opening)
        in_flight: list[asyncio.Future[None] | None] = [None] * self.num_buffers
        for entry in staged[1:]:
            in_flight[entry.slot] = asyncio.ensure_future(self._part(failures, [entry], {}))
        index = len(staged)
        try:
            for bucket, last in planned:
                slot = index % self.num_buffers
                if in_flight[slot] is not None:
                    await in_flight[slot]  # every engine is done with this buffer
                    in_flight[slot] = None
                (entry,) = await self._stage_layouts([(slot, bucket)])
                if last:
                    await asyncio.gather(*(f for f in in_flight if f is not None))
                    in_flight = [None] * self.num_buffers
                    await self._part(failures, [entry], closing)
                else:
                    in_flight[slot] = asyncio.ensure_future(self._part(failures, [entry], {}))
                index += 1
        finally:
            # Never return (or raise) while an engine may still read a buffer.
            await asyncio.gather(*(f for f in in_flight if f is not None), return_exceptions=True)

    async def _stage_layouts(self, buckets: list[tuple[int, list[_Item]]]) -> list[_Staged]:
        """Each `(slot, bucket)` copied into buffer `slot`, in one call to the staging thread
        with one wait for the copies, each with its layout's id (a new one when the buffer or
        the tensors in it changed since the buffer was last filled)."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        flats = await loop.run_in_executor(self._stager(), self._fill_all, buckets)
        staged = []
        for (slot, bucket), flat in zip(buckets, flats, strict=True):
            layout = self._layouts[slot].setdefault(_signature(bucket), new_layout_id())
            self.buckets_sent.append(flat.numel())
            staged.append(_Staged(slot, layout, flat, bucket))
        self.timings["stage"].append(time.perf_counter() - started)
        return staged

    def _forget_layouts(self, slot: int) -> None:
        self._dead_layouts.update(self._layouts[slot].values())
        self._layouts[slot] = {}
        self._views[slot] = {}

    async def _part(
        self,
        failures: dict[Any, BaseException | None],
        staged: list[_Staged],
        fields: dict[str, Any],
    ) -> None:
        """One whole-update request to every engine that has not failed yet."""
        started = time.perf_counter()
        engines = list(failures)
        live = [e for e in engines if failures[e] is None]
        results = await asyncio.gather(
            *(self._post_whole(engines.index(e), e, staged, fields) for e in live),
            return_exceptions=True,
        )
        for engine, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                failures[engine] = result
        self.timings["engines"].append(time.perf_counter() - started)

    async def _post_whole(
        self, index: int, engine: Any, staged: list[_Staged], fields: dict[str, Any]
    ) -> None:
        from verst.fleet.client import EngineError

        known = self._known.setdefault(engine, set())
        released = sorted(known & self._dead_layouts)
        known.difference_update(released)
        fields = {**fields, "release_layouts": released} if released else fields

        async def post() -> dict[str, Any]:
            body = _whole_body(staged, known, fields)
            return await asyncio.wait_for(engine.update_weights_from_buffers(body), self._timeout_s)

        try:
            try:
                reply = await post()
            except EngineError as error:
                if error.status != UNKNOWN_LAYOUT_STATUS:
                    raise
                known.clear()  # the engine restarted, or let layouts go: every payload again
                reply = await post()
        except TimeoutError:
            raise TimeoutError(f"engine {index}: no answer within {self._timeout_s:g} s") from None
        except EngineError as error:
            raise _refusal(index, error) from error
        known.update(entry.layout for entry in staged)
        expected = fields.get("weight_version")
        if expected is not None and reply.get("weight_version") != expected:
            raise SharedTensorError(
                f"engine {index} answered version {reply.get('weight_version')!r} to the update "
                f"to version {expected}"
            )

    async def _post(self, engines: list[Any], bodies: list[dict[str, Any]]) -> None:
        from verst.fleet.client import EngineError

        async def one(index: int, engine: Any, body: dict[str, Any]) -> None:
            try:
                await engine.update_weights_from_tensor(body)
            except EngineError as error:
                raise _refusal(index, error) from error

        started = time.perf_counter()
        await asyncio.gather(
            *(one(i, e, b) for i, (e, b) in enumerate(zip(engines, bodies, strict=True)))
        )
        self.timings["engines"].append(time.perf_counter() - started)

    def close(self) -> None:
        """Free the staging buffers (engines let go of their mappings as newer ones arrive)."""
        self._buffers = [None] * self.num_buffers
        self._layouts = [{} for _ in range(self.num_buffers)]
        self._views = [{} for _ in range(self.num_buffers)]
        self._dead_layouts = set()
        self._known = WeakKeyDictionary()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
