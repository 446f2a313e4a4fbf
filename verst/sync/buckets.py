"""What every transport sends: the model's full parameters, one at a time, in bounded buckets;
or (LoRA) one adapter, whole, in one bucket, with the fields that address it to the engines'
adapter registry."""

from __future__ import annotations

import functools
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


def adapter_tensors(
    trainable: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, adapter: str | None = None
) -> Iterator[NamedTensor]:
    """The LoRA adapter tensors among `trainable` (the trainer's `trainable_parameters`; with
    `adapter`, that adapter's alone), full, cast to `dtype`, named as engines take them."""
    tensors = full_parameters(trainable, keep=functools.partial(is_adapter, adapter=adapter))
    return ((wire_name(n), t) for n, t in cast_together(tensors, dtype))


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
