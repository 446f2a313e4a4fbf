"""What every transport sends: the model's full parameters, one at a time, in bounded buckets."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor

NamedTensor = tuple[str, torch.Tensor]


def full_parameters(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[NamedTensor]:
    """Every parameter as a full tensor (an FSDP2 shard is gathered, a collective, one tensor at
    a time, never the whole model at once), cast to `dtype` when given."""
    for name, param in model.named_parameters():
        data = param.data
        full = data.full_tensor() if isinstance(data, DTensor) else data
        yield name, full if dtype is None else full.to(dtype)


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
