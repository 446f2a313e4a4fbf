"""The models a run trains with: the policy (inside its `Trainer`), an unsharded shell of it
(its config and tied-weight layout, for saving), and, when the loss needs them, the frozen KL
reference and the PPO critic.

The reference is the policy as RL starts (after any warm start); it is also written to
`run_dir/reference` so that `--resume` restores the very same reference. With LoRA
(`model.lora`) the reference is that policy with its adapters merged, a plain HF model, and
checkpoints hold the adapters alone, in peft's format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from verst import distributed
from verst.models.lora import LoraConfig, save_adapters
from verst.train.algorithms import LossConfig
from verst.train.checkpoint import load_weights
from verst.train.critic import ValueModel
from verst.train.trainer import Trainer

REFERENCE_DIR = "reference"


@dataclass
class PolicyModels:
    trainer: Trainer
    shell: PreTrainedModel
    loss: LossConfig
    run_dir: Path
    lora: LoraConfig | None = None  # set when the trainer's model carries adapters

    def weights_writer(self) -> Callable[[Path], None]:
        """Gather the policy's weights now (a collective: every rank calls it) and return what
        writes them into a directory: peft's adapter files with LoRA (a directory an adapter with
        multi-LoRA), else an HF model."""
        if self.trainer.lora:
            assert self.lora is not None, "a LoRA trainer needs PolicyModels.lora"
            adapters, lora = self.trainer.adapter_state_dict(), self.lora
            return lambda out: save_adapters(out, adapters, lora)
        weights = self.trainer.full_state_dict()
        return lambda out: self.shell.save_pretrained(
            out, state_dict=weights, safe_serialization=True
        )

    def start_rl(self) -> None:
        """After any warm start: snapshot the policy as the KL reference (also on disk, for
        resume) and start the PPO critic from the policy's body."""
        if self.loss.needs_reference_model:
            weights = self.trainer.full_state_dict()
            # before the save: save_pretrained drops a tied model's shared entries from the dict
            self.trainer.set_reference(self.shell, weights)
            if distributed.rank() == 0:
                self.shell.save_pretrained(self.run_dir / REFERENCE_DIR, state_dict=weights)
            distributed.barrier()
        if self.loss.needs_critic:
            self.trainer.attach_critic(ValueModel(self.shell))

    def restore(self, weights: dict[str, torch.Tensor], trainer_state: dict) -> None:
        """Policy, optimizer (and critic) from a checkpoint, the reference from its snapshot."""
        if self.loss.needs_critic:
            self.trainer.attach_critic(ValueModel(self.shell))  # weights come from the state
        self.trainer.load_state(weights, trainer_state)
        if self.loss.needs_reference_model:
            self.trainer.set_reference(self.shell, load_weights(self.run_dir / REFERENCE_DIR))
