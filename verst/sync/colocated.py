"""Colocated weight sync: trainer and engine share a process and a device.

When a rank holds whole parameters (a world of one) in the engine's dtype, the engine's
parameters are re-pointed at the trainer's storage once, and every later update is only a
version bump: the optimiser writes the very tensors the engine reads. Otherwise each push
gathers full tensors bucket by bucket and copies them into the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from verst.engine import Engine
from verst.train import distributed
from verst.train.trainer import Trainer


def _full_tensors(
    model: torch.nn.Module, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Unsharded parameters in buckets of at most `bucket_bytes` (a lone tensor may exceed it)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in model.named_parameters():
        data = param.data
        full = data.full_tensor() if isinstance(data, DTensor) else data
        if bucket and size + full.numel() * full.element_size() > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full))
        size += full.numel() * full.element_size()
    if bucket:
        yield bucket


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


class ColocatedSync:
    def __init__(self, trainer: Trainer, engine: Engine, *, bucket_bytes: int = 512 << 20) -> None:
        self.trainer = trainer
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.zero_copy = share_storage(trainer, engine.model)

    def push(self, version: int) -> dict[str, float]:
        """Make the engine generate with the trainer's current weights, stamped `version`."""
        if not self.zero_copy:
            for bucket in _full_tensors(self.trainer.model, self.bucket_bytes):
                self.engine.update_weights_from_tensors(bucket, version)
        self.engine.set_weight_version(version)
        return {}
