"""bench/roofline.py's byte counts against a hand count on a tiny Qwen3."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from roofline import (  # noqa: E402
    decode_roofline_tok_s,
    kv_bytes_per_token,
    memory_bandwidth,
    weight_bytes_per_step,
)

SHAPE = dict(
    vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)  # fmt: skip


def _model(tied: bool) -> torch.nn.Module:
    config = transformers.Qwen3Config(tie_word_embeddings=tied, **SHAPE)
    return transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)


def _layer_params() -> int:
    attention = 32 * 16 * (4 + 2 + 2) + 4 * 16 * 32 + 2 * 16  # q, k, v, o; q/k norms
    mlp = 3 * 32 * 48
    return attention + mlp + 2 * 32  # two RMSNorms


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_count_the_head_once_and_not_the_embedding(tied: bool) -> None:
    params = 2 * _layer_params() + 32 + 100 * 32  # layers, final norm, LM head
    assert weight_bytes_per_step(_model(tied)) == 2 * params


def test_kv_bytes_and_the_roofline() -> None:
    model = _model(True)
    per_token = 2 * 2 * 2 * 16 * 2  # K and V, layers, KV heads, head dim, bf16
    assert kv_bytes_per_token(model) == per_token
    step_bytes = weight_bytes_per_step(model) + 8 * (10 + 20 / 2) * per_token
    assert decode_roofline_tok_s(model, 8, 10, 20, 1e9) == pytest.approx(8 * 1e9 / step_bytes)


def test_cpu_bandwidth_is_measured() -> None:
    assert memory_bandwidth("cpu", nbytes=1 << 24, repeats=3) > 1e8
