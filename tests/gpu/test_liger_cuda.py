"""trainer.kernels=liger on CUDA: the policy's norms and MLPs run Liger's kernels, and a bf16
step with them equals a step without them within bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_token_logprobs_cuda import VOCAB, _items
from verst.models import TinyModelConfig, build_tiny_model
from verst.train.algorithms import LossConfig
from verst.train.trainer import Trainer, TrainerConfig

pytest.importorskip("liger_kernel")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _trainer(family: str, kernels: str, **overrides) -> Trainer:
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    model = build_tiny_model(TinyModelConfig(family=family, **shape), vocab_size=VOCAB, seed=0)
    cfg = TrainerConfig(lr=1e-3, device="cuda", kernels=kernels, **overrides)
    return Trainer(
        model,
        cfg,
        LossConfig(entropy_coef=0.01),
        total_steps=4,
        pad_token_id=0,
        device=torch.device("cuda"),
    )


def test_liger_steps_equal_plain_ones() -> None:
    # the plain steps first: Liger also swaps the family's classes and rotary function in
    # transformers' modules, so models built after it in this process are Liger's
    families = ("qwen2", "qwen3", "llama")
    plain = {}
    for family in families:
        trainer = _trainer(family, "torch")
        assert trainer.model.model.layers[0].mlp._get_name() != "LigerSwiGLUMLP"
        plain[family] = trainer.step(_items(), step=1)
    for family in families:
        for checkpointing in (False, True):
            liger = _trainer(family, "liger", gradient_checkpointing=checkpointing)
            assert liger.model.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"
            metrics = liger.step(_items(), step=1)
            for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
                expected = plain[family][key]
                assert metrics[key] == pytest.approx(expected, rel=3e-2, abs=3e-3), (family, key)
