"""The trainer's chunked token scores on CUDA in bf16: a step with them equals a step with the
full logits, within bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from verst.models import TinyModelConfig, build_char_tokenizer, build_tiny_model
from verst.train.algorithms import LossConfig
from verst.train.batching import TrainItem
from verst.train.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = len(build_char_tokenizer())


def _items() -> list[TrainItem]:
    gen = torch.Generator().manual_seed(0)
    items = []
    for i in range(8):
        tokens = torch.randint(5, VOCAB, (24,), generator=gen).tolist()
        items.append(TrainItem(tokens, 16, [1] * 16, [-2.0] * 16, 1.0 if i % 2 else -1.0))
    return items


def _step(chunk_tokens: int) -> dict[str, float]:
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    model = build_tiny_model(TinyModelConfig(**shape), vocab_size=VOCAB, seed=0)
    cfg = TrainerConfig(lr=1e-3, device="cuda", logprob_chunk_tokens=chunk_tokens)
    trainer = Trainer(
        model,
        cfg,
        LossConfig(entropy_coef=0.01),
        total_steps=4,
        pad_token_id=0,
        device=torch.device("cuda"),
    )
    return trainer.step(_items(), step=1)


def test_chunked_step_equals_full_logits_step_in_bf16() -> None:
    full, chunked = _step(0), _step(5)
    keys = ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm")
    for key in (*keys, "train/train_rollout_logprob_abs_diff"):
        assert chunked[key] == pytest.approx(full[key], rel=2e-2, abs=2e-3), key


def test_trainer_attention_avoids_cudnn_plans() -> None:
    """The trainer's prompt and continuation passes attend through SDPA with a mask, at lengths
    that change every step; cuDNN's backend would build a plan for each (`SHAPE_FREE_SDPA`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(chunk_tokens=0)
    names = [e.key for e in prof.key_averages()]
    assert any("scaled_dot_product" in n for n in names)
    assert not any("cudnn" in n.lower() for n in names), names
