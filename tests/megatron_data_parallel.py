"""Run under torchrun (gloo, CPU) by tests/test_megatron_objectives.py: in a world of N ranks,
the megatron backend at TP = PP = 1 (data parallel N) and the FSDP2 backend (sharded over the
N ranks) take the same steps on the same global batch: an SFT step, a KL-loss step against
the step-0 reference, and a whitened REINFORCE++ step with the KL as reward. Each rank hands
its own share of items; rank 0 writes the largest differences it saw."""

from __future__ import annotations

import json
import sys

import torch

from tests.test_megatron_objectives import _items, _pair
from verst import distributed
from verst.train.algorithms import LossConfig


def _largest_weight_diff(megatron, fsdp) -> float:
    """On rank 0 (FSDP2's full state dict is rank 0's alone); 0 elsewhere."""
    ours, theirs = megatron.full_state_dict(), fsdp.full_state_dict()
    if not theirs:
        return 0.0
    return max(float((tensor - theirs[name]).abs().max()) for name, tensor in ours.items())


def main() -> None:
    out = sys.argv[1]
    distributed.init_distributed(torch.device("cpu"))
    rank, world = distributed.rank(), distributed.world_size()
    megatron, fsdp = _pair(LossConfig(), reference=True)

    def share(seed: int) -> list:
        return _items(seed)[rank::world]

    diffs: dict[str, list[float]] = {"loss": [], "grad_norm": [], "weights": []}

    def compare(ours: dict, theirs: dict, prefix: str) -> None:
        diffs["loss"].append(abs(ours[f"{prefix}loss"] - theirs[f"{prefix}loss"]))
        relative = ours[f"{prefix}grad_norm"] / theirs[f"{prefix}grad_norm"] - 1
        diffs["grad_norm"].append(abs(relative))
        diffs["weights"].append(_largest_weight_diff(megatron, fsdp))

    items = share(1)
    ours = megatron.sft_step(items, megatron.optimizer, step=1, scheduler=megatron.scheduler)
    theirs = fsdp.sft_step(items, fsdp.optimizer, step=1, scheduler=fsdp.scheduler)
    compare(ours, theirs, "")
    held_out = share(2)
    ours, theirs = megatron.sft_eval(held_out), fsdp.sft_eval(held_out)
    eval_diff = max(abs(value - theirs[key]) for key, value in ours.items())
    losses = [
        LossConfig(kl_loss_coef=0.5),
        LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.2),
    ]
    for step, loss in enumerate(losses, start=2):
        megatron.loss_cfg = fsdp.loss_cfg = loss
        items = share(step + 1)
        compare(megatron.step(items, step=step), fsdp.step(items, step=step), "train/")
    if rank == 0:
        result = {key: max(values) for key, values in diffs.items()}
        json.dump(result | {"eval": eval_diff, "world": world}, open(out, "w"))


if __name__ == "__main__":
    main()
