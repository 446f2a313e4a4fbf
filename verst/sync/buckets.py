"""What every transport sends: the model's full parameters, one at a time, in bounded buckets;
or (LoRA) one adapter, whole, in one bucket, with the fields that address it to the engines'
adapter registry."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from verst.models.lora import is_adapter, wire_name
from verst.plugins import AdapterUpdate

NamedTensor = tuple[str, torch.Tensor]


def full_parameters(
    model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[NamedTensor]:
    """Every parameter of `model` (a module, or its (name, parameter) pairs, such as the
    trainer's `trainable_parameters`, whose walk is cheaper than the module tree's) or those
    whose name `keep` accepts, as a full tensor (an FSDP2 shard is gathered, a collective, one
    tensor at a time, never the whole model at once), cast to `dtype` when given. In a world of
    one the shard is the whole tensor and is taken as it is: DTensor's gather costs about 50 µs
    of Python a tensor, which was most of a LoRA push."""
    named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
    for name, param in named:
        if keep is not None and not keep(name):
            continue
        if not isinstance(param, DTensor):
            full = param.data
        elif param.device_mesh.size() == 1:
            # the shard is the whole tensor; `to_local()` gives a view of this very tensor
            # through an autograd function, 8-20 µs a call, most of a many-tensor LoRA walk
            full = param._local_tensor.detach()
        else:
            full = param.data.full_tensor()
        yield name, full if dtype is None else full.to(dtype)


class AdapterTensors:
    """The LoRA adapter tensors among a trainer's `trainable_parameters` (with `adapter`, that
    adapter's alone), full, cast to `dtype`, named as engines take them, read again on every
    call. A rank-16 adapter of a 0.5B model is 336 small tensors, so per-tensor Python is most
    of a push: in a world of one the walk (names, shards, flat views, the cast's output) is done
    once and a call is one concatenation and one cast; the walk is redone when a
    parameter's storage moves. A call's tensors are views of one buffer that the next call
    overwrites: every transport is done with them when its push returns."""

    def __init__(
        self,
        trainable: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        adapter: str | None = None,
    ) -> None:
        self.params = [(n, p) for n, p in trainable if is_adapter(n, adapter=adapter)]
        self.names = [wire_name(n) for n, _ in self.params]
        self.dtype = dtype
        self.sharded = any(
            isinstance(p, DTensor) and p.device_mesh.size() > 1 for _, p in self.params
        )
        self._addresses: list[int] = []
        self._flat: list[torch.Tensor] = []
        self._cast: torch.Tensor | None = None
        self._pieces: list[torch.Tensor] = []

    def __call__(self) -> Iterator[NamedTensor]:
        if self.sharded:  # each tensor gathered from its shards, a collective every rank joins
            gathered = cast_together(full_parameters(self.params), self.dtype)
            yield from zip(self.names, (t for _, t in gathered), strict=True)
            return
        shards = [p._local_tensor if isinstance(p, DTensor) else p for _, p in self.params]
        # the flat views hold the storage they view, so an address seen again is that storage
        addresses = [t.data_ptr() for t in shards]
        if addresses != self._addresses:
            self._walk(shards, addresses)
        if self._cast is None:  # nothing to cast: no copy either
            yield from zip(self.names, (t.detach() for t in shards), strict=True)
            return
        # cat into an output of another dtype takes a slow path (2.6 ms for 336 tensors on an
        # H200, against 0.1 ms for a cat and a cast)
        self._cast.copy_(torch.cat(self._flat))
        yield from zip(self.names, self._pieces, strict=True)

    def _walk(self, shards: list[torch.Tensor], addresses: list[int]) -> None:
        self._addresses, self._flat = addresses, [t.detach().view(-1) for t in shards]
        self._cast, self._pieces = None, []
        if shards and any(t.dtype != self.dtype for t in shards):
            total = sum(t.numel() for t in shards)
            self._cast = torch.empty(total, dtype=self.dtype, device=shards[0].device)
            pieces = self._cast.split([t.numel() for t in shards])
            self._pieces = [p.view(t.shape) for p, t in zip(pieces, shards, strict=True)]


def cast_together(named: Iterable[NamedTensor], dtype: torch.dtype) -> Iterator[NamedTensor]:
    """`named` cast to `dtype` with one concatenation and one cast, not a kernel per tensor: a
    LoRA adapter is hundreds of small tensors, and casting each alone is launch-bound. The
    results are views of one buffer."""
    pairs = list(named)
    if all(t.dtype == dtype for _, t in pairs):  # nothing to cast: no copy either
        yield from pairs
        return
    flat = torch.cat([t.reshape(-1) for _, t in pairs]).to(dtype)
    pieces = flat.split([t.numel() for _, t in pairs])
    for (name, tensor), piece in zip(pairs, pieces, strict=True):
        yield name, piece.view(tensor.shape)


def bucketed(named: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive tensors in buckets of at most `bucket_bytes` (a larger one goes alone), taken
    from `named` only as each bucket fills."""
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def bucket_limit(bucket_bytes: int, adapter: AdapterUpdate | None) -> int:
    """`bucket_bytes`, or no limit for an adapter: it goes in one call, so that an engine never
    holds an adapter half old and half new, or one missing modules while it is being made."""
    return bucket_bytes if adapter is None else sys.maxsize


def adapter_fields(adapter: AdapterUpdate | None) -> dict[str, Any]:
    """The fields of an update request's body that address it to `adapter` (none without)."""
    if adapter is None:
        return {}
    return {"lora_name": adapter.name, "lora_config": adapter.config}
