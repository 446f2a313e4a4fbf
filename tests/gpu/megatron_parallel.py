"""Run under torchrun by tests/gpu/test_megatron_cuda.py: one GRPO step of the megatron
backend at the layout given on the command line (tp pp ep family), whose loss and exported
weights rank 0 compares with the FSDP2 backend's step on the same items (bf16 tolerance)."""

from __future__ import annotations

import copy
import json
import sys

from tests.test_megatron_backend import _hf_logprobs, _items, _model
from verst import distributed
from verst.train.algorithms import LossConfig
from verst.train.megatron.config import MegatronConfig
from verst.train.megatron.trainer import MegatronTrainer
from verst.train.trainer import TrainerConfig


def main() -> None:
    tp, pp, ep, family, out = *map(int, sys.argv[1:4]), sys.argv[4], sys.argv[5]
    device = distributed.resolve_device("cuda")
    distributed.init_distributed(device)
    model = _model(family)
    layout = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
    cfg = TrainerConfig(backend="megatron", megatron=layout, dtype="bfloat16", lr=1e-3)
    trainer = MegatronTrainer(copy.deepcopy(model), cfg, LossConfig(), total_steps=2,
                              pad_token_id=0, device=device)  # fmt: skip
    items = _items()
    ours = trainer.logprobs(items)
    metrics = trainer.step(items, step=1)
    weights = trainer.full_state_dict()
    if distributed.rank() == 0:
        theirs = _hf_logprobs(model.to(device), items)
        diff = max(
            abs(a - b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True)
        )
        names = sorted(weights)
        json.dump({"max_logprob_diff": diff, "loss": metrics["train/loss"], "names": names},
                  open(out, "w"))  # fmt: skip


if __name__ == "__main__":
    main()
