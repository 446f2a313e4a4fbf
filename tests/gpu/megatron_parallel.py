"""Run under torchrun by tests/gpu/test_megatron_cuda.py: at the layout given on the command
line (tp pp ep family), the megatron backend's log-probs (rank 0 compares them with the HF
forward, bf16 tolerance), a GRPO step, a step with a KL loss to a frozen reference and
whitened advantages, a REINFORCE++ step with the KL as reward, and a supervised step and
evaluation; rank 0 writes what it measured."""

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
    trainer.set_reference(model, model.state_dict())  # step 0: a second GPTModel, this layout
    trainer.loss_cfg = LossConfig(kl_loss_coef=0.5, normalize_advantages=True)
    kl_loss = trainer.step(_items(1), step=2)["train/kl_loss"]
    trainer.loss_cfg = LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1)
    kl_reward_loss = trainer.step(_items(2), step=3)["train/loss"]
    sft = trainer.sft_step(_items(3), trainer.optimizer, step=4)
    held_out = trainer.sft_eval(_items(4))
    weights = trainer.full_state_dict()
    if distributed.rank() == 0:
        theirs = _hf_logprobs(model.to(device), items)
        diff = max(
            abs(a - b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True)
        )
        result = {
            "max_logprob_diff": diff, "loss": metrics["train/loss"], "names": sorted(weights),
            "kl_loss": kl_loss, "kl_reward_loss": kl_reward_loss, "sft_loss": sft["loss"],
            "sft_grad_norm": sft["grad_norm"], "eval_loss": held_out["eval/loss"],
        }  # fmt: skip
        json.dump(result, open(out, "w"))


if __name__ == "__main__":
    main()
