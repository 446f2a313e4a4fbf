"""Optimizer state in host memory between steps (`trainer.offload: optimizer`).

AdamW keeps two fp32 moments per parameter: twice the weights' memory, idle on the device
while the engines generate. Between steps they live in pinned host buffers; the optimiser
phase takes them back to the device for its step. Each tensor keeps its storage object and
only the storage's memory comes and goes (`resize_`, as FSDP2 frees its gathered
parameters), so the optimiser, its DTensors and a checkpoint's state dict see the same
tensors throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

_Key = tuple[int, int, str]  # (optimizer, parameter, state entry)


class OptimizerOffload:
    """Moves the state of `optimizers()` (called each time: an optimiser made later, a PPO
    critic's, is covered) between `device` and host memory."""

    def __init__(
        self, optimizers: Callable[[], list[torch.optim.Optimizer]], device: torch.device
    ) -> None:
        self.optimizers = optimizers
        self.device = device
        self.on_host = False
        self._host: dict[_Key, torch.Tensor] = {}
        self._storage_bytes: dict[_Key, int] = {}

    def _state(self) -> Iterator[tuple[_Key, torch.Tensor]]:
        for o, optimizer in enumerate(self.optimizers()):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for p, param in enumerate(params):
                for name, value in optimizer.state.get(param, {}).items():
                    local = value.to_local() if isinstance(value, DTensor) else value
                    if isinstance(local, torch.Tensor) and _on(local, self.device):
                        yield (o, p, name), local

    def to_host(self) -> int:
        """Copy the state to host memory and free its device memory; the bytes moved."""
        if self.on_host:
            return 0
        moved = []
        for key, local in self._state():
            host = self._host.get(key)
            if host is None or host.shape != local.shape or host.dtype != local.dtype:
                pin = self.device.type == "cuda"
                host = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
                self._host[key] = host
            host.copy_(local, non_blocking=True)
            self._storage_bytes[key] = local.untyped_storage().nbytes()
            moved.append(local)
        _synchronize(self.device)  # the copies must land before the memory goes
        for local in moved:
            local.untyped_storage().resize_(0)
        self.on_host = True
        return sum(local.numel() * local.element_size() for local in moved)

    def to_device(self) -> None:
        """Give the state its device memory back, with the values `to_host` took."""
        if not self.on_host:
            return
        for key, local in self._state():
            if local.untyped_storage().nbytes() > 0:
                continue  # never offloaded: made (or replaced by a restore) since
            local.untyped_storage().resize_(self._storage_bytes[key])
            local.copy_(self._host[key], non_blocking=True)
        _synchronize(self.device)
        self.on_host = False

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The state on the device inside (a checkpoint's save or restore), as it was after."""
        offloaded = self.on_host
        self.to_device()
        try:
            yield
        finally:
            if offloaded:
                self.to_host()


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` is on `device` (`cuda` meaning the current CUDA device)."""
    same_index = device.index is None or tensor.device.index == device.index
    return tensor.device.type == device.type and same_index


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
