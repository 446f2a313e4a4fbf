"""MoE in the engine: experts dispatched as one grouped GEMM, and the experts each token was
routed to returned as SGLang's `routed_experts` (in-process, and base64 on `/generate`),
equal to the choices of a full HF forward over the same tokens, prefix cache or not."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from verst.engine import GenerateRequest, SamplingParams, Scheduler
from verst.engine.results import DetokenizeParams, ResultShaper
from verst.models import TinyModelConfig, build_char_tokenizer, build_tiny_model
from verst.models.moe import gate_weights, hook_routers, routers, routing_shape

VOCAB = len(build_char_tokenizer())
SHAPE = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
    max_position_embeddings=64, num_experts=8, experts_per_token=2,
)  # fmt: skip
MOE = ["qwen3-moe", "mixtral", "deepseek-v3", "gpt-oss"]


def tiny(family: str) -> PreTrainedModel:
    return build_tiny_model(TinyModelConfig(family=family, **SHAPE), vocab_size=VOCAB, seed=0)


def engine(model: PreTrainedModel, **options) -> Scheduler:
    return Scheduler.for_model(
        model, eos_token_ids=[], pad_token_id=0, kv_cache_bytes=4 << 20, page_size=4, **options
    )


def hf_choices(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), layers, k] the experts a full HF forward picks (-1 in dense layers)."""
    shape = routing_shape(model)
    out = torch.full((len(tokens), shape.layers, shape.top_k), -1, dtype=torch.int32)

    def keep(layer, router, output):
        out[:, layer] = output[2].to("cpu", torch.int32)

    handles = hook_routers(model, keep)
    with torch.no_grad():
        model(torch.tensor([tokens], device=model.device))
    for handle in handles:
        handle.remove()
    return out


@pytest.mark.parametrize("family", MOE)
def test_routed_experts_equal_a_full_forward(family: str) -> None:
    model = tiny(family)
    params = SamplingParams(max_new_tokens=9, temperature=1.0, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 77, 21, 8, 30, 31], [5, 9, 14, 3, 77, 21, 8, 30, 40], [7]]
    scheduler = engine(model)
    requests = [GenerateRequest(p, params, return_routed_experts=True) for p in prompts]
    outs = scheduler.generate(requests)
    # again: the shared prompt pages now come from the prefix cache, with their routing
    outs += scheduler.generate([GenerateRequest(prompts[0], params, return_routed_experts=True)])
    assert outs[-1].cached_tokens > 0
    shape = routing_shape(model)
    for prompt, out in zip(prompts + [prompts[0]], outs, strict=True):
        tokens = prompt + out.output_ids
        assert out.routed_experts.dtype == torch.int32
        assert out.routed_experts.shape == (len(tokens) - 1, shape.layers, shape.top_k)
        expected = hf_choices(model, tokens)[:-1]
        # the experts of a token are a set: their order follows the scores' ties
        assert torch.equal(out.routed_experts.sort(-1).values, expected.sort(-1).values)
    if family == "deepseek-v3":  # its first layer is dense
        assert (outs[0].routed_experts[:, 0] == -1).all()


def test_dense_model_refuses_return_routed_experts() -> None:
    model = build_tiny_model(TinyModelConfig(**{**SHAPE}), vocab_size=VOCAB, seed=0)
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="return_routed_experts: the model has no mixture"):
        engine(model).generate([GenerateRequest([1, 2], params, return_routed_experts=True)])


def test_grouped_experts_equal_the_eager_loop() -> None:
    model = tiny("qwen3-moe")
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(ids).logits
        model.set_experts_implementation("grouped_mm")
        grouped = model(ids).logits
    torch.testing.assert_close(grouped, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", MOE)
def test_gate_weights_at_its_own_choices_are_its_weights(family: str) -> None:
    model = tiny(family)
    seen = []
    hook_routers(model, lambda layer, router, out: seen.append((router, out)))
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5, 6]]))
    assert len(seen) == len(routers(model))
    for router, (logits, weights, ids) in seen:
        torch.testing.assert_close(gate_weights(router, logits, ids), weights)


def test_routed_experts_on_generate_are_sglang_base64() -> None:
    model = tiny("qwen3-moe")
    params = SamplingParams(max_new_tokens=3)
    request = GenerateRequest([4, 5, 6], params, return_routed_experts=True)
    out = engine(model).generate([request])[0]
    result = ResultShaper(build_char_tokenizer()).finished(
        request, DetokenizeParams(), 0.0, out, "0"
    )
    raw = base64.b64decode(result.meta_info["routed_experts"])
    rows = np.frombuffer(raw, dtype=np.int32).reshape(-1, 2, 2)
    assert np.array_equal(rows, out.routed_experts.numpy())
