"""Colocated weight sync for the embedded engine: the trainer and a `Scheduler` it calls
directly share a process and a device.

When a rank holds whole parameters (a world of one) in the engine's dtype, the engine's
parameters are re-pointed at the trainer's storage once, and every later update is only a
version bump: the optimiser writes the very tensors the engine reads. Otherwise each push
gathers full tensors bucket by bucket and copies them into the engine. Either way the prefix
cache, which holds KV of the old weights, is dropped. The loop is synchronous, so the engine is
idle during a push: there is nothing to pause.
"""

from __future__ import annotations

import torch

from verst import distributed
from verst.engine import Scheduler
from verst.sync.buckets import bucketed, full_parameters
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


class ColocatedSync:
    def __init__(
        self, trainer: Trainer, engine: Scheduler, *, bucket_bytes: int = 512 << 20
    ) -> None:
        self.trainer = trainer
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.zero_copy = share_storage(trainer, engine.model)

    def push(self, version: int) -> dict[str, float]:
        """Make the engine generate with the trainer's current weights, stamped `version`."""
        if not self.zero_copy:
            dtype = next(self.engine.model.parameters()).dtype
            for bucket in bucketed(full_parameters(self.trainer.model, dtype), self.bucket_bytes):
                self.engine.update_weights_from_tensors(bucket, version)
        self.engine.set_weight_version(version)
        self.engine.weights_changed()
        return {}
