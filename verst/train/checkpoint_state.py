"""What a checkpoint holds of the trainer beyond the weights: the optimisers' and schedules'
state and, for PPO, the critic's weights and optimiser (a mixin of `Trainer`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from verst import distributed
from verst.train.offload import OptimizerOffload


def _state_on_device(method: Callable) -> Callable:
    """Run `method` with offloaded optimizer state (`trainer.offload`) back on the device."""

    @functools.wraps(method)
    def with_state(self: CheckpointState, *args: Any, **kwargs: Any) -> Any:
        with self.offload.on_device() if self.offload is not None else nullcontext():
            return method(self, *args, **kwargs)

    return with_state


class CheckpointState:
    """`Trainer`'s state for a checkpoint, and its restore."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    adapter_optimizers: dict[str, Any]
    critic: torch.nn.Module | None
    critic_optimizer: torch.optim.Optimizer
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler
    lora: bool
    offload: OptimizerOffload | None

    @_state_on_device
    def optimizer_state(self) -> dict:
        """Optimiser and schedule state (and the critic's weights and optimiser, for PPO)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
            "scheduler": self.scheduler.state_dict(),
        }
        if self.adapter_optimizers:
            state["adapters"] = {
                name: {
                    "optimizer": get_optimizer_state_dict(self.model, optimizer, options=options),
                    "scheduler": scheduler.state_dict(),
                }
                for name, (optimizer, scheduler) in self.adapter_optimizers.items()
            }
        if self.critic is not None:
            state["critic"] = {
                "weights": get_model_state_dict(self.critic, options=options),
                "optimizer": get_optimizer_state_dict(
                    self.critic, self.critic_optimizer, options=options
                ),
                "scheduler": self.critic_scheduler.state_dict(),
            }
        return state

    @_state_on_device
    def load_state(self, weights: dict[str, torch.Tensor], optimizer_state: dict | None) -> None:
        """Weights as `full_state_dict` gave them (rank 0's, on every rank: the others' may be
        empty), or with LoRA the adapters alone (the base is the one the model was built with)."""
        full = dict(full_state_dict=True, broadcast_from_rank0=distributed.world_size() > 1)
        options = StateDictOptions(**full, strict=not self.lora)
        set_model_state_dict(self.model, weights, options=options)
        if optimizer_state is not None:
            set_optimizer_state_dict(
                self.model, self.optimizer, optimizer_state["optimizer"], options=options
            )
            self.scheduler.load_state_dict(optimizer_state["scheduler"])
        for name, saved in (optimizer_state or {}).get("adapters", {}).items():
            optimizer, scheduler = self.adapter_optimizers[name]
            set_optimizer_state_dict(self.model, optimizer, saved["optimizer"], options=options)
            scheduler.load_state_dict(saved["scheduler"])
        critic_state = (optimizer_state or {}).get("critic")
        if self.critic is not None and critic_state is not None:
            set_model_state_dict(self.critic, critic_state["weights"], options=options)
            set_optimizer_state_dict(
                self.critic, self.critic_optimizer, critic_state["optimizer"], options=options
            )
            self.critic_scheduler.load_state_dict(critic_state["scheduler"])
