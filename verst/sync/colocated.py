"""Colocated weight sync: the engine shares the trainer's process (or host) and device.

`share_storage` re-points an engine's parameters at the trainer's own tensors when a rank holds
whole parameters (a world of one) with the same names, shapes, dtypes and device: every later
update is then only a version bump, since the optimiser writes the very tensors the engine
reads. The embedded engine's sync (`verst.sync.embedded`) uses it.
"""

from __future__ import annotations

import torch

from verst import distributed
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
