"""LoRA adapters in the engine on CUDA: a batch mixing adapters through the decode CUDA graphs
equals the eager engine and peft's model, and graphs captured before an adapter arrived are
captured again (they read the adapters' stacked buffers by address)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_qwen3
from verst.engine import GenerateRequest, SamplingParams
from verst.engine.paged_attention import triton
from verst.engine.scheduler import Scheduler
from verst.models.lora import LoraConfig, apply_lora, wire_name

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton"
)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [5, 6, 7, 8, 9], [3, 4]]
NEW = 12


def adapted(base: torch.nn.Module, rank: int, seed: int) -> tuple[torch.nn.Module, dict, dict]:
    cfg = LoraConfig(rank=rank, alpha=2.0 * rank)
    model = copy.deepcopy(base)
    apply_lora(model, cfg)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
                tensors[wire_name(name)] = param.detach().clone()
    return model.eval(), cfg.wire_config(), tensors


def engine(model: torch.nn.Module, graphs: bool) -> Scheduler:
    return Scheduler.for_model(
        model, eos_token_ids=[], pad_token_id=0, kv_cache_bytes=64 << 20, cuda_graphs=graphs
    )


def run(scheduler: Scheduler, adapters: list[str | None]) -> list:
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    requests = [
        GenerateRequest(list(p), params, lora_path=a)
        for p, a in zip(PROMPTS, adapters, strict=True)
    ]
    return scheduler.generate(requests)


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    for _ in range(NEW):
        ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_adapters_through_cuda_graphs(dtype: torch.dtype) -> None:
    base = tiny_qwen3()
    a, a_cfg, a_tensors = adapted(base, 4, seed=1)
    b, b_cfg, b_tensors = adapted(base, 8, seed=2)
    outputs = {}
    for graphs in (True, False):
        scheduler = engine(copy.deepcopy(base).to("cuda", dtype), graphs)
        assert scheduler.runner.cuda_graphs is graphs
        run(scheduler, [None] * len(PROMPTS))  # graphs captured before any adapter
        scheduler.load_adapter("a", a_cfg, a_tensors, "tensors")
        scheduler.load_adapter("b", b_cfg, b_tensors, "tensors")
        outputs[graphs] = run(scheduler, ["a", None, "b", "a"])
    graphed, eager = outputs[True], outputs[False]
    assert [o.output_ids for o in graphed] == [o.output_ids for o in eager]
    for g, e in zip(graphed, eager, strict=True):
        assert (
            max(
                abs(x - y)
                for x, y in zip(g.output_token_logprobs, e.output_token_logprobs, strict=True)
            )
            < 1e-3
        )
    if dtype == torch.float32:  # peft's own forward, token by token
        references = [a, base, b, a]
        for out, model, prompt in zip(graphed, references, PROMPTS, strict=True):
            assert out.output_ids == greedy(model.to("cuda"), prompt)
