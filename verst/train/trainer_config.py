"""The trainer's settings (`TrainerConfig`, the `trainer:` section), its compute dtype and its
learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field

from verst.configbase import ConfigBase
from verst.train.megatron.config import MegatronConfig


class TrainerConfig(ConfigBase):
    backend: Literal["fsdp2", "megatron"] = Field(
        "fsdp2", description="training backend: PyTorch FSDP2, or Megatron-core (TP / PP / EP)"
    )
    megatron: MegatronConfig = Field(
        default_factory=MegatronConfig, description="parallel layout of the megatron backend"
    )
    lr: float = Field(1e-6, gt=0, description="peak learning rate of AdamW")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="decay after warm-up, down to min_lr_ratio × lr at the last step"
    )
    lr_warmup_steps: int = Field(0, ge=0, description="steps of linear learning-rate warm-up")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    critic_lr: float | None = Field(
        None, gt=0, description="learning rate of the PPO critic; None = lr"
    )
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm; 0 disables")
    micro_batch_tokens: int = Field(
        16384, ge=1, description="token budget per micro-batch (padded length × sequences)"
    )
    logprob_chunk_tokens: int = Field(
        4096,
        ge=0,
        description="tokens whose full-vocabulary logits exist at once when the trainer scores "
        "responses (log-probs, entropy; recomputed in the backward); 0 = a micro-batch's at once",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in the backward: about a third "
        "more compute for far less activation memory (fsdp2 backend)",
    )
    offload: Literal["none", "optimizer"] = Field(
        "none",
        description="optimizer: AdamW's state waits in host memory between steps, on the "
        "device only for the optimizer step (CUDA; frees twice the weights' memory)",
    )
    kernels: Literal["torch", "liger"] = Field(
        "torch",
        description="liger: Liger's Triton RMSNorm, SwiGLU and rotary kernels in the policy's "
        "layers (CUDA; pip install 'verst[liger]')",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="compute dtype; auto = bfloat16 on CUDA, float32 on CPU"
    )
    true_on_policy: bool = Field(
        False,
        description="engine and trainer compute log-probs through one batch-invariant forward, "
        "so train/train_rollout_logprob_abs_diff is exactly 0 (Llama family, Qwen3-MoE; CPU)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="training device; auto = CUDA when available"
    )


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm is NaN/inf; the weights were not updated."""


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _lr_lambda(cfg: TrainerConfig, total_steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.lr_warmup_steps:
            return (step + 1) / cfg.lr_warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        span = max(total_steps - cfg.lr_warmup_steps, 1)
        progress = min((step - cfg.lr_warmup_steps) / span, 1.0)
        if cfg.lr_schedule == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return factor
