"""MoE on CUDA: the engine's grouped expert dispatch and routing capture (eager decode: MoE
models run without CUDA graphs) against a full HF forward, and one routing-replay trainer
step, in bf16 and fp32."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_moe_engine import hf_choices, tiny
from tests.test_routing_replay import PROMPTS, flippy, rollout
from verst.engine import GenerateRequest, SamplingParams, Scheduler
from verst.models.moe import routing_shape
from verst.train.algorithms import LossConfig
from verst.train.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "deepseek-v3"])
def test_cuda_engine_routes_as_hf(family: str, dtype: torch.dtype) -> None:
    model = tiny(family).to("cuda", dtype)
    engine = Scheduler.for_model(
        copy.deepcopy(model), eos_token_ids=[], pad_token_id=0, kv_cache_bytes=16 << 20,
        page_size=4,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 77, 21], [7], [40, 2, 11]]
    outs = engine.generate(
        [GenerateRequest(p, params, return_routed_experts=True) for p in prompts]
    )
    shape = routing_shape(model)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = prompt + out.output_ids
        assert out.routed_experts.shape == (len(tokens) - 1, shape.layers, shape.top_k)
        expected = hf_choices(model, tokens)[:-1]
        same = out.routed_experts.sort(-1).values == expected.sort(-1).values
        # bf16 kernels of a batch and of a full forward round apart: a few choices may flip
        assert same.float().mean() >= (1.0 if dtype == torch.float32 else 0.9)


def test_cuda_replay_step_bf16() -> None:
    model = flippy(noise=1e-3).to("cuda")
    items = rollout(model, PROMPTS)
    trainer = Trainer(
        copy.deepcopy(model).cpu(), TrainerConfig(lr=1e-3, device="cuda", dtype="bfloat16"),
        LossConfig(routing_replay=True), total_steps=2, pad_token_id=0,
        device=torch.device("cuda"),
    )  # fmt: skip
    metrics = trainer.step(items, step=0)
    assert 0 < metrics["train/routing_agreement"] <= 1
    assert metrics["train/grad_norm"] > 0
