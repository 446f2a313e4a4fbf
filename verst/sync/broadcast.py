"""Broadcast transport: a process group of its own joins the trainer (rank 0) and the engines.

The group is separate from the trainer's own (FSDP) group: a TCP store at
`master_address:master_port` and a gloo (CPU) or NCCL (CUDA) backend, built on both sides
without touching the default group. Engines join it through SGLang's
`/init_weights_update_group` (engine rank = `rank_offset`) and receive weights through
`/update_weights_from_distributed`: per call, one bucket of tensors whose names, dtypes and
shapes travel in the HTTP body while the bytes travel through the group, flattened into one
buffer (`load_format: "flattened_bucket"`) or tensor by tensor (SGLang's default). Buckets hold
at most `bucket_bytes` (a single larger tensor travels alone).

A `verst serve` engine is updated in one request instead (`BroadcastTransport.update_whole`):
`POST /verst/update_weights_from_distributed` carries the pause mode, the flush, the version and
the continue, and every bucket travels through the group behind a header that also travels
through it (`send_header`: the JSON of its names, dtypes and shapes and whether it is the
last, in one broadcast of HEADER_BYTES unless the JSON is longer). So the tensors are walked
once, as they are sent (one bucket ahead), and one HTTP round trip serves the whole update
whatever the number of buckets.

A broadcast only completes when every member posts one of the same size, and gloo takes a
shorter message into a larger buffer without a word: a member that fell out of step (it got a
header the others did not) would install whatever landed in its buffer. So the trainer sends
nothing more on a group once one of its collectives failed (an abort header only when walking
the tensors failed, when every engine waits for a header), and each bucket of a whole update
ends with the random tag its header announced: an engine whose bucket does not end with it
refuses the update (`BucketOutOfStep`) instead of installing the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from verst.plugins import AdapterUpdate, EngineClient
from verst.sync.buckets import adapter_fields, bucket_limit, bucketed
from verst.sync.protocol import takes_whole_updates

WHOLE_UPDATE_PATH = "/verst/update_weights_from_distributed"
# a whole update's header: a magic number, its JSON's length, flags and the bucket's tag
# (int64 each), then the JSON
HEADER_BYTES = 1 << 16
_HEAD = 32
HEADER_MAGIC = 0x7665727374484452  # "verstHDR"
TAG_BYTES = 8  # a whole update's bucket ends with its tag, an int64
LAST, ABORTED = 1, 2  # flags: the last bucket; the trainer's side failed


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch name without the prefix, e.g. "bfloat16"
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.torch_dtype).element_size()


def _listen(address: str, port: int) -> socket.socket:
    """A listening socket bound to `address` (IPv4 or IPv6) and `port`."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def create_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    group_name: str = "weight_update_group",
    timeout_s: float = 300.0,
    connect_timeout_s: float | None = None,
) -> dist.Backend:
    """A standalone process group (every member calls this; rank 0 hosts the store).

    Rank 0's store listens on `master_address` only (TCPStore alone would listen on every
    interface); the store's rendezvous gives up after `connect_timeout_s` (default
    `timeout_s`), the group's collectives after `timeout_s`."""
    connect = timedelta(seconds=connect_timeout_s if connect_timeout_s else timeout_s)
    if rank == 0:
        listener = _listen(master_address, master_port)
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=True,
            timeout=connect,
            master_listen_fd=listener.detach(),
        )
    else:
        store = dist.TCPStore(master_address, master_port, world_size, timeout=connect)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout_s))
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RuntimeError("backend 'nccl' needs a CUDA build of torch; use 'gloo' on CPU")
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def bucket_specs(body: dict[str, Any]) -> list[TensorSpec]:
    """The `TensorSpec`s of an `/update_weights_from_distributed` body: SGLang's parallel lists
    `names`, `dtypes`, `shapes` (ValueError naming what is wrong)."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes: Field required (lists)")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes must have the same length")
    return [
        TensorSpec(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    ]


def spec_fields(specs: list[TensorSpec]) -> dict[str, list]:
    """The parallel lists `bucket_specs` reads."""
    return {
        "names": [s.name for s in specs],
        "dtypes": [s.dtype for s in specs],
        "shapes": [list(s.shape) for s in specs],
    }


def send_header(
    group: dist.Backend,
    specs: list[TensorSpec],
    device: torch.device,
    *,
    last: bool = False,
    aborted: bool = False,
    tag: int = 0,
) -> None:
    """Rank 0 announces the next bucket of a whole update (`specs`; none: no bucket follows),
    whether it is the `last`, and the `tag` its bytes end with; `aborted`: the trainer failed,
    install nothing more. One broadcast of HEADER_BYTES, a second for the JSON that does not
    fit."""
    payload = json.dumps(spec_fields(specs)).encode() if specs else b""
    flags = (LAST if last else 0) | (ABORTED if aborted else 0)
    head = bytearray(HEADER_BYTES)
    head[:_HEAD] = struct.pack("<qqqq", HEADER_MAGIC, len(payload), flags, tag)
    fits = payload[: HEADER_BYTES - _HEAD]
    head[_HEAD : _HEAD + len(fits)] = fits
    group.broadcast(torch.frombuffer(head, dtype=torch.uint8).to(device), 0).wait()
    if len(payload) > len(fits):
        rest = bytearray(payload[len(fits) :])
        group.broadcast(torch.frombuffer(rest, dtype=torch.uint8).to(device), 0).wait()


def header_device(group: dist.Backend, device: torch.device) -> torch.device:
    """Where a whole update's headers travel: NCCL moves GPU tensors only (`device`, the
    weights'), gloo the CPU's."""
    return device if group.name() == "nccl" else torch.device("cpu")


class TrainerAborted(RuntimeError):
    """The trainer's side of a whole update failed before its end."""


class BucketOutOfStep(RuntimeError):
    """A whole update's bucket did not end with its header's tag, or a header did not start
    with the magic number: this engine's broadcasts and the trainer's fell out of step, and
    the bytes are not what they should be."""


class Header(NamedTuple):
    specs: list[TensorSpec]  # the next bucket's tensors; none: no bucket follows
    last: bool
    tag: int  # what the bucket's bytes end with


def receive_header(group: dist.Backend, device: torch.device) -> Header:
    """An engine's side of `send_header` (`TrainerAborted` when the trainer gave up)."""
    head = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
    group.broadcast(head, 0).wait()
    raw = head.cpu().numpy().tobytes()
    magic, size, flags, tag = struct.unpack("<qqqq", raw[:_HEAD])
    if magic != HEADER_MAGIC:
        raise BucketOutOfStep(
            "a weight update's header did not start with its magic number: this engine's "
            "broadcasts and the trainer's fell out of step"
        )
    if flags & ABORTED:
        raise TrainerAborted("the trainer's side of the weight update failed")
    payload = raw[_HEAD : _HEAD + size]
    if size > len(payload):
        rest = torch.empty(size - len(payload), dtype=torch.uint8, device=device)
        group.broadcast(rest, 0).wait()
        payload += rest.cpu().numpy().tobytes()
    specs = bucket_specs(json.loads(payload)) if size else []
    return Header(specs, bool(flags & LAST), tag)


class FlatBuffer:
    """One flat byte buffer that every bucket reuses (grown to the largest), so no bucket
    allocates (or, on the CPU, pages in) its bytes. A bucket overwrites it only once the last
    collective on it is done: gloo's finish on return; on CUDA each collective's `wait` makes
    the current stream wait for it, and the next bucket is written on that stream."""

    def __init__(self) -> None:
        self._bytes: torch.Tensor | None = None

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._bytes is None or self._bytes.numel() < nbytes or self._bytes.device != device:
            self._bytes = None  # the old one goes before the new one is made
            self._bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._bytes[:nbytes]


def send_bucket(
    group: dist.Backend,
    tensors: list[torch.Tensor],
    *,
    flattened: bool,
    staging: FlatBuffer | None = None,
    tag: int | None = None,
) -> None:
    """Rank 0's side of one bucket (flattened: copied into `staging`, or a new buffer, and
    ended with `tag` when given)."""
    if not flattened:
        for tensor in tensors:
            group.broadcast(tensor.contiguous(), 0).wait()
        return
    device = tensors[0].device
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if tag is not None:
        parts.append(_tag_bytes(tag).to(device, non_blocking=True))
    if staging is None:
        flat = torch.cat(parts)
    else:
        flat = staging.take(sum(p.numel() for p in parts), device)
        torch._foreach_copy_(list(flat.split([p.numel() for p in parts])), parts)
    group.broadcast(flat, 0).wait()


def _tag_bytes(tag: int) -> torch.Tensor:
    return torch.tensor([tag], dtype=torch.int64).view(torch.uint8)


def receive_bucket(
    group: dist.Backend,
    specs: list[TensorSpec],
    device: torch.device,
    *,
    flattened: bool,
    into: FlatBuffer | None = None,
    tag: int | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """An engine's side of one bucket: the tensors, by name (flattened: views into `into`,
    valid until its next bucket, or into a new buffer; with `tag`, `BucketOutOfStep` unless
    the bytes end with it)."""
    if not flattened:
        received = []
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=spec.torch_dtype, device=device)
            group.broadcast(tensor, 0).wait()
            received.append((spec.name, tensor))
        return received
    nbytes = sum(s.nbytes for s in specs)
    tail = 0 if tag is None else TAG_BYTES
    if into is None:
        flat = torch.empty(nbytes + tail, dtype=torch.uint8, device=device)
    else:
        flat = into.take(nbytes + tail, device)
    group.broadcast(flat, 0).wait()
    if tag is not None and not torch.equal(flat[nbytes:].cpu(), _tag_bytes(tag)):
        raise BucketOutOfStep(
            f"a bucket of {nbytes} bytes did not end with its header's tag: this engine's "
            "broadcasts and the trainer's fell out of step, so nothing of it is installed"
        )
    received, offset = [], 0
    for spec in specs:
        chunk = flat[offset : offset + spec.nbytes]
        received.append((spec.name, chunk.view(spec.torch_dtype).reshape(spec.shape)))
        offset += spec.nbytes
    return received


class BroadcastTransport:
    """The trainer's side: `connect` forms the group with the engines (a first `send` does it
    too), `send` broadcasts to it. When every engine is a `verst serve` (`whole_update_engines`),
    `update_whole` runs the whole update protocol in one request per engine instead.

    A send to another set of engines than the group's (one died, one joined) first re-forms the
    group with exactly those engines, on a fresh port; members that join no group within
    `join_timeout_s` make the send fail."""

    def __init__(
        self,
        *,
        master_port: int,
        master_address: str = "127.0.0.1",
        bucket_bytes: int = 512 << 20,
        backend: str = "gloo",
        group_name: str = "weight_update_group",
        join_timeout_s: float = 300.0,
        whole_updates: bool = True,
    ) -> None:
        self.master_address = master_address
        self.master_port = master_port
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.group_name = group_name
        self.join_timeout_s = join_timeout_s
        self.group: dist.Backend | None = None
        self.members: list[EngineClient] = []  # the engines of the group, by rank - 1
        self.connects = 0
        self.buckets_sent: list[int] = []  # bytes of each bucket of the last send
        self.whole_updates = whole_updates  # `update_whole` to verst engines; False: SGLang's calls
        # every flattened bucket's bytes, on the tensors' device; one per group, so a send
        # left behind on a dropped group never writes into the buffer of the next one's
        self.staging = FlatBuffer()

    async def connect(self, engines: list[EngineClient]) -> None:
        if self.connects:  # the old group's store may still hold the port
            self.master_port = _free_port(self.master_address)
        self.connects += 1
        self.group, self.members, self.staging = None, [], FlatBuffer()
        world_size = 1 + len(engines)
        joins = [
            e.init_weights_update_group(
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=rank,
                world_size=world_size,
                group_name=self.group_name,
                backend=self.backend,
            )
            for rank, e in enumerate(engines, start=1)
        ]
        own = asyncio.to_thread(
            create_group,
            master_address=self.master_address,
            master_port=self.master_port,
            rank=0,
            world_size=world_size,
            backend=self.backend,
            group_name=self.group_name,
            connect_timeout_s=self.join_timeout_s,
        )
        self.group, *_ = await asyncio.gather(own, *joins)
        self.members = list(engines)

    async def send(
        self,
        engines: list[EngineClient],
        tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        version: int,
        adapter: AdapterUpdate | None = None,
    ) -> None:
        if self.group is None or not _same_members(self.members, engines):
            await self.connect(engines)
        self.buckets_sent = []
        try:
            # tensors are taken (for FSDP2: gathered) as the buckets fill, never all at once
            for bucket in bucketed(tensors(), bucket_limit(self.bucket_bytes, adapter)):
                await self._send_bucket(engines, bucket, adapter_fields(adapter))
        except BaseException:
            self.group = None  # a broken collective: the next send forms a new group
            raise

    async def _send_bucket(
        self,
        engines: list[EngineClient],
        bucket: list[tuple[str, torch.Tensor]],
        fields: dict[str, Any],
    ) -> None:
        specs = [TensorSpec.of(name, t) for name, t in bucket]
        body = {
            **spec_fields(specs),
            "group_name": self.group_name,
            "load_format": "flattened_bucket",
            **fields,
        }
        await asyncio.gather(
            asyncio.to_thread(
                send_bucket,
                self.group,
                [t for _, t in bucket],
                flattened=True,
                staging=self.staging,
            ),
            *(e.update_weights_from_distributed(body) for e in engines),
        )
        self.buckets_sent.append(sum(s.nbytes for s in specs))

    # ---- verst engines: the whole update in one request -------------------------------------

    async def whole_update_engines(self, engines: list[EngineClient]) -> list[EngineClient]:
        """Every one of `engines` when each takes verst's whole-update request, else none: they
        share one group, so one broadcast serves them all or none. None with `whole_updates`
        off."""
        if not self.whole_updates or not engines:
            return []
        return list(engines) if all(await takes_whole_updates(engines)) else []

    async def update_whole(
        self,
        engines: list[EngineClient],
        tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        version: int,
        pause_mode: str,
        timeout_s: float | None = None,
    ) -> dict[EngineClient, BaseException | None]:
        """One request per engine pauses it in `pause_mode`, flushes its cache (but in place),
        receives every bucket through the group, stamps `version` and continues; meanwhile the
        tensors are walked once and broadcast, each bucket behind its header. Each engine's
        failure (no answer within `timeout_s` is one), or None where it answered `version`."""
        if self.group is None or not _same_members(self.members, engines):
            await self.connect(engines)
        body = {
            "group_name": self.group_name,
            "pause_mode": pause_mode,
            "flush_cache": pause_mode != "in_place",
            "weight_version": str(version),
            "continue_generation": True,
        }
        self.buckets_sent = []
        sending = asyncio.ensure_future(asyncio.to_thread(self._send_whole, tensors))
        replies = await asyncio.gather(
            *(
                asyncio.wait_for(e.update_weights_whole_from_distributed(body), timeout_s)
                for e in engines
            ),
            return_exceptions=True,
        )
        sent = await self._sent(sending, all(not isinstance(r, BaseException) for r in replies))
        return {
            engine: _whole_failure(index, sent, reply, str(version))
            for index, (engine, reply) in enumerate(zip(engines, replies, strict=True))
        }

    def _send_whole(self, tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        """Rank 0's side of a whole update: each bucket's header, then its bytes; the walk runs
        one bucket ahead so the last header says so (or, when walking the tensors failed, an
        abort, so no engine waits for more)."""
        # the update's group, buffer and count, even if a failed engine makes `update_whole`
        # drop them and a later update make its own
        group, staging, sent = self.group, self.staging, self.buckets_sent
        assert group is not None
        walk = _Walk(group, lambda: bucketed(tensors(), self.bucket_bytes), self._first_device())
        bucket = walk.next()
        if bucket is None:
            send_header(group, [], walk.device, last=True)
        while bucket is not None:
            walk.device = header_device(group, bucket[0][1].device)
            following = walk.next()
            specs = [TensorSpec.of(name, t) for name, t in bucket]
            tag = secrets.randbits(63)
            send_header(group, specs, walk.device, last=following is None, tag=tag)
            send_bucket(group, [t for _, t in bucket], flattened=True, staging=staging, tag=tag)
            sent.append(sum(s.nbytes for s in specs))
            bucket = following

    def _first_device(self) -> torch.device:
        """Where headers go when no tensor has said (nothing to send, or the walk failed)."""
        on_gpu = self.backend == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    async def _sent(self, sending: asyncio.Future[None], answered: bool) -> BaseException | None:
        """The broadcast's outcome. When an engine failed, it may never have joined the
        collectives: the group is dropped (the next send forms a new one) and the sending
        thread left to its collectives' timeout rather than waited for."""
        if not answered:
            self.group = None
            sending.add_done_callback(lambda f: f.cancelled() or f.exception())
            return None
        try:
            await sending
        except BaseException as error:
            self.group = None
            return error
        return None


class _Walk:
    """The tensors' walk, a bucket at a time. When walking fails, every engine waits for a
    header: it gets an abort before the error is raised. A failed collective is raised as it
    is, with nothing more sent: its members may each wait for a different broadcast."""

    def __init__(
        self,
        group: dist.Backend,
        buckets: Callable[[], Iterable[list[tuple[str, torch.Tensor]]]],
        device: torch.device,
    ) -> None:
        self.group, self._start, self._buckets = group, buckets, None
        self.device = device  # where headers travel

    def next(self) -> list[tuple[str, torch.Tensor]] | None:
        try:
            if self._buckets is None:
                self._buckets = iter(self._start())
            return next(self._buckets, None)
        except Exception:
            with contextlib.suppress(Exception):
                send_header(self.group, [], self.device, aborted=True)
            raise


def _whole_failure(
    index: int, sent: BaseException | None, reply: Any, version: str
) -> BaseException | None:
    if isinstance(reply, TimeoutError):
        return TimeoutError(f"engine {index}: no answer to the weight update")
    if isinstance(reply, BaseException):
        return reply
    if sent is not None:
        return sent
    answered = reply.get("weight_version") if isinstance(reply, dict) else None
    if answered != version:
        return RuntimeError(
            f"engine {index} answered version {answered!r} to the update to version {version}"
        )
    return None


def _same_members(members: list[EngineClient], engines: list[EngineClient]) -> bool:
    return len(members) == len(engines) and all(
        a is b for a, b in zip(members, engines, strict=True)
    )


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
