"""The supervised objective on one micro-batch, shared by both trainer backends: the loss of a
step (NLL of the masked tokens over the step's global token count) and the sums behind the
held-out metrics, which each backend reduces over its ranks before `eval_metrics`.
"""

from __future__ import annotations

import torch

from verst.train.batching import MicroBatch
from verst.train.losses import logprobs_from_logits

# Supervised steps score the model itself, not the rollout's tempered policy: a warm start before
# RL sampled at T = 0.5 would otherwise fit softmax(z / 0.5) to the data, leaving logits z half
# the size, so sampling at 0.5 would sharpen nothing (and T = 1 would be near uniform).
SFT_TEMPERATURE = 1.0


def nll_loss(logprobs_B_T: torch.Tensor, mask_B_T: torch.Tensor, token_norm: float):
    """This micro-batch's share of the step's mean negative log-likelihood."""
    return -(logprobs_B_T * mask_B_T).sum() / token_norm


EVAL_SUMS = ("nll", "tokens", "right_tokens", "right_examples", "examples")


def eval_sums(logits_B_T_V: torch.Tensor, micro: MicroBatch) -> dict[str, float]:
    """The `EVAL_SUMS` of one micro-batch: an example is right when greedy decoding would
    write every masked token of it."""
    mask = micro.loss_mask_B_T
    logprobs = logprobs_from_logits(logits_B_T_V, micro.response_ids_B_T)
    right = (logits_B_T_V.argmax(-1) == micro.response_ids_B_T).float()
    scored = mask.sum(-1) > 0  # a rank's stand-in rows carry no mask
    whole = ((right * mask).sum(-1) == mask.sum(-1)) & scored
    sums = [-(logprobs * mask).sum(), mask.sum(), (right * mask).sum(), whole.sum(), scored.sum()]
    return {name: float(value) for name, value in zip(EVAL_SUMS, sums, strict=True)}


def eval_metrics(sums: dict[str, float]) -> dict[str, float]:
    """`eval/*` from the `EVAL_SUMS` of every micro-batch of every rank."""
    tokens = max(sums["tokens"], 1.0)
    return {
        "eval/loss": sums["nll"] / tokens,
        "eval/token_accuracy": sums["right_tokens"] / tokens,
        "eval/accuracy": sums["right_examples"] / max(sums["examples"], 1.0),
        "eval/num_examples": sums["examples"],
    }
