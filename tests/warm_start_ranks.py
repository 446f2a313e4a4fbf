"""Run under torchrun (gloo, CPU) by tests/test_sft.py: a warm start on two FSDP2 ranks whose
dev checks read 0.0, 0.18 and 0.74 against a target of 0.3 overshoots and goes back to the
check nearer the target (step 4). The weights kept at that check are a full state dict, which
is rank 0's alone; rank 0 writes whether the final weights are that check's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.test_trainer import items, make_trainer, tiny_model
from verst import distributed
from verst.train.sft import WarmStartConfig, warm_start


def main() -> None:
    out = sys.argv[1]
    distributed.init_distributed(torch.device("cpu"))
    rank = distributed.rank()
    trainer = make_trainer(tiny_model())
    cfg = WarmStartConfig(
        enabled=True, batch_size=2, lr=1e-2, max_steps=20, target_accuracy=0.3,
        check_interval_steps=2, keep_nearest=True,
    )  # fmt: skip
    accuracies, seen = [0.0, 0.18, 0.74], {}

    def dev_accuracy() -> float:
        seen[2 * (len(seen) + 1)] = trainer.full_state_dict()  # a collective; rank 0's is full
        return accuracies[len(seen) - 1]

    result = warm_start(cfg, trainer, items(), dev_accuracy, print, seed=0)
    final = trainer.full_state_dict()
    if rank == 0:
        back = all(torch.equal(final[k], seen[4][k]) for k in final)
        moved = not all(torch.equal(final[k], seen[6][k]) for k in final)
        Path(out).write_text(json.dumps({**result, "back": back, "moved_since": moved}))


if __name__ == "__main__":
    main()
