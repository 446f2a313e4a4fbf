"""Process-group setup shared by the trainer and the loop: one process, or N under torchrun.

Under torchrun the usual env vars (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR…) are read; a
plain `verst train` gets a world of one through an in-memory store, so no port is opened.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def resolve_device(name: str) -> torch.device:
    """'auto' picks this rank's GPU when CUDA is available, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device is 'cuda' but CUDA is not available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_distributed(device: torch.device) -> None:
    if dist.is_initialized():
        return
    # one group serving both device types, so CPU and CUDA collectives work in one process
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum(values: list[float], device: torch.device, group: Any = None) -> list[float]:
    """Sum a few scalars over all ranks (or the ranks of `group`) in one collective."""
    if world_size() == 1 or (group is not None and dist.get_world_size(group) == 1):
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Every rank's copy of `module` takes rank 0's parameters and buffers (a collective; the
    module must be on this rank's device)."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def all_reduce_max(value: int, device: torch.device) -> int:
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()
