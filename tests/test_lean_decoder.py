"""The engine's lean forward computes what HF's forward computes, for each architecture it reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from verst.engine import GenerateRequest, SamplingParams
from verst.engine.kv_pool import KVPool
from verst.engine.lean_decoder import LeanDecoder, OneBuffer, readable
from verst.engine.model_runner import ModelRunner, Row
from verst.engine.scheduler import Scheduler

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def build(kind: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **COMMON))
    if kind == "qwen2":  # Q/K/V biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
    if kind == "llama":  # untied head, rope scaling
        config = transformers.LlamaConfig(
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            **COMMON,
        )
        return transformers.LlamaForCausalLM(config)
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON))
    raise ValueError(kind)


def runner_for(model: torch.nn.Module, dtype: torch.dtype, lean: bool) -> ModelRunner:
    config = model.config
    pool = KVPool(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or 16,
        page_size=4,
        num_pages=64,
        dtype=dtype,
        device="cpu",
    )
    return ModelRunner(model, pool, lean=lean)


def prompt_then_decode(runner: ModelRunner) -> list[torch.Tensor]:
    """Two prompts fed whole (all logits), then one decode step each; the pages differ."""
    prompts = [[5, 9, 14, 3, 77, 21, 8], [40, 2, 11]]
    pages = [[1, 2, 3], [7, 8]]
    _, full = runner.forward(
        [
            Row(tokens=p, past=0, pages=pg, all_logits=True)
            for p, pg in zip(prompts, pages, strict=True)
        ]
    )
    last, _ = runner.forward(
        [Row(tokens=[17], past=len(p), pages=pg) for p, pg in zip(prompts, pages, strict=True)]
    )
    return [full[0], full[1], last]


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "mistral"])
def test_lean_forward_equals_hf_forward_in_fp32(kind: str) -> None:
    model = build(kind).eval()
    assert readable(model)
    lean = prompt_then_decode(runner_for(model, torch.float32, lean=True))
    hf = prompt_then_decode(runner_for(model, torch.float32, lean=False))
    for got, want in zip(lean, hf, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and both equal a plain HF forward of the whole sequence
    with torch.no_grad():
        full = model(torch.tensor([[5, 9, 14, 3, 77, 21, 8, 17]])).logits[0]
    torch.testing.assert_close(lean[0], full[:7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lean[2][0], full[7], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_lean_forward_in_bf16_is_close_to_hf(kind: str) -> None:
    model = build(kind).to(torch.bfloat16).eval()
    lean = prompt_then_decode(runner_for(model, torch.bfloat16, lean=True))
    hf = prompt_then_decode(runner_for(model, torch.bfloat16, lean=False))
    for got, want in zip(lean, hf, strict=True):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_other_architectures_run_hf_forward() -> None:
    torch.manual_seed(0)
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=16, **COMMON))
    assert not readable(gemma) and LeanDecoder.of(gemma) is None
    gelu = build("llama")
    gelu.config.hidden_act = "gelu"
    assert not readable(gelu)
    runner = runner_for(gemma, torch.float32, lean=True)
    assert runner.lean is None
    prompt_then_decode(runner)


def test_scheduler_greedy_output_is_the_same_lean_or_not() -> None:
    model = build("qwen3").eval()
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 5 + j) % 90 + 1 for j in range(3 + 2 * i)] for i in range(4)]

    def outputs(lean: bool) -> list[list[int]]:
        runner = runner_for(model, torch.float32, lean)
        scheduler = Scheduler(
            model, runner.pool, eos_token_ids=[], pad_token_id=0, lean_forward=lean
        )
        done = scheduler.generate(
            [GenerateRequest(input_ids=p, sampling_params=params) for p in prompts]
        )
        return [d.output_ids for d in done]

    assert outputs(True) == outputs(False)


def test_one_buffer_runs_linears_as_one_gemm_and_keeps_in_place_updates() -> None:
    torch.manual_seed(0)
    linears = [torch.nn.Linear(8, n, bias=True) for n in (8, 4, 4)]  # Q, K, V with biases
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = [m(x) for m in linears]
    params = [p for m in linears for p in (m.weight, m.bias)]
    one = OneBuffer(linears)
    assert all(isinstance(p, torch.nn.Parameter) for p in params)  # the same objects
    assert all(m.weight is p for m, p in zip(linears, params[::2], strict=True)) and one.intact()
    got = F.linear(x, one.weight, one.bias).split([8, 4, 4], dim=-1)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with torch.no_grad():  # a weight update's in-place copy lands in the buffer
        linears[1].weight.copy_(torch.full((4, 8), 0.5))
        linears[2].bias.zero_()
    torch.testing.assert_close(one.weight[8:12], torch.full((4, 8), 0.5))
    assert one.bias[12:].eq(0).all()
    # released and resumed (`verst.engine.memory`): the storage moves, the views with it
    storage = one.weight.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    storage.resize_(nbytes)
    assert one.intact()
    # re-pointed elsewhere (a zero-copy share of the trainer's storage): no longer intact
    linears[0].weight.data = torch.zeros(8, 8)
    assert not one.intact()


def test_one_buffer_is_for_cuda_and_uniform_linears_only() -> None:
    assert OneBuffer.of([torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)]) is None  # the CPU
    model = build("qwen2")  # on the CPU the lean forward keeps Q/K/V apart in fp32
    lean = LeanDecoder(model)
    assert all(layer.qkv.one_buffer is None for layer in lean.layers)
