"""FP8 rollout (`engine.quantization: fp8`): e4m3 quantization within its closed-form error, the
fp8 linear within the error that implies, an fp8 engine close to the bf16 forward, weights
quantized again at every update, a `verst train` run with TIS, and what cannot run refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import tiny_qwen3, tiny_qwen3_pool
from tests.test_lean_decoder import COMMON, build
from verst.cli import main
from verst.config import ConfigError, help_text, load_config
from verst.engine import GenerateOutput, GenerateRequest, SamplingParams, Scheduler
from verst.engine.kernels.fp8_linear import (
    FP8_MAX,
    Fp8Weight,
    dequantize,
    fp8_linear,
    max_error,
    quantize_rows,
)
from verst.engine.lean_decoder import LEAN_FAMILIES, readable
from verst.engine.model_runner import ModelRunner
from verst.models.families import FAMILIES
from verst.models.tiny import TinyModelConfig, build_tiny_model

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [12], [20, 21, 22, 23, 24]]
NEW_TOKENS = 12


def spread_rows(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows whose values span 2^-20 to 2^4 (e4m3's subnormals and normals), and a zero row."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen) * 2.0 ** torch.randint(-20, 4, (6, 64), generator=gen)
    x[3] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_within_the_e4m3_bound(dtype: torch.dtype) -> None:
    x = spread_rows(dtype)
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 2, 4, 5]], torch.full((5,), FP8_MAX))
    error = (dequantize(q, scale) - x.float()).abs()
    bound = max_error(x)
    assert (error <= bound * (1 + 1e-6)).all()
    assert (error / bound).max() > 0.5  # the bound is tight, not slack
    assert not error[3].any()  # a zero row (a padding token) stays zero, no NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_within_the_error_its_inputs_carry(dtype: torch.dtype) -> None:
    """|x̂ŵᵀ − xwᵀ| ≤ |δx||w|ᵀ + |x||δw|ᵀ + |δx||δw|ᵀ for the elementwise bounds δ of each
    input, plus the output's own rounding to `dtype`."""
    torch.manual_seed(0)
    x, w, bias = torch.randn(5, 64), torch.randn(48, 64) * 0.1, torch.randn(48)
    x, w, bias = x.to(dtype), w.to(dtype), bias.to(dtype)
    got = fp8_linear(x.view(1, 5, 64), Fp8Weight.of(w), bias)
    assert got.shape == (1, 5, 48) and got.dtype == dtype
    exact = x.float() @ w.float().T + bias.float()
    dx, dw = max_error(x), max_error(w)
    bound = dx @ w.float().abs().T + x.float().abs() @ dw.T + dx @ dw.T
    bound += exact.abs() * torch.finfo(dtype).eps + 1e-5
    assert ((got[0].float() - exact).abs() <= bound).all()


def test_fused_projections_quantize_like_each_alone() -> None:
    """Per-channel scales: the fused Q/K/V weight's fp8 copy is each one's copy, stacked."""
    q_w, k_w = torch.randn(32, 64), torch.randn(16, 64) * 5
    fused = Fp8Weight.of(torch.cat([q_w, k_w]))
    alone = [Fp8Weight.of(w) for w in (q_w, k_w)]
    assert torch.equal(fused.weight_O_I.float(), torch.cat([a.weight_O_I.float() for a in alone]))
    assert torch.equal(fused.scale_1_O, torch.cat([a.scale_1_O for a in alone], dim=1))


def engine(model: torch.nn.Module, quantization: str = "none") -> Scheduler:
    dtype = next(model.parameters()).dtype
    pool = tiny_qwen3_pool(dtype, num_pages=64)
    return Scheduler(model, pool, eos_token_ids=[], pad_token_id=0, quantization=quantization)


def greedy(scheduler: Scheduler) -> list[GenerateOutput]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return scheduler.generate([GenerateRequest(list(p), params) for p in PROMPTS])


def logprob_gap(model: torch.nn.Module, outputs: list[GenerateOutput]) -> float:
    """Mean |engine log-prob − the model's full forward's| over the sampled tokens."""
    gaps, device = [], next(model.parameters()).device
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            ids = torch.tensor([prompt + out.output_ids], device=device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
            full = logits.log_softmax(-1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
            gaps.append((full - torch.tensor(out.output_token_logprobs)).abs())
    return float(torch.cat(gaps).mean())


def fake_quantized(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose projections compute dequantize(quantize(x)) dequantize(quantize(
    w))ᵀ in float32: the fp8 forward's math, without fp8 kernels."""
    fake = copy.deepcopy(model)
    for name, module in fake.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("proj"):
            w_hat = dequantize(*quantize_rows(module.weight.detach()))

            def forward(x: torch.Tensor, w_hat: torch.Tensor = w_hat) -> torch.Tensor:
                x_hat = dequantize(*quantize_rows(x.reshape(-1, x.shape[-1])))
                return (x_hat @ w_hat.T).to(x.dtype).view(*x.shape[:-1], -1)

            module.forward = forward
    return fake


def test_fp8_engine_computes_the_fake_quantized_forward() -> None:
    """In fp32 the engine's fp8 GEMMs are exact products of the quantized operands: its
    log-probs are those of the fake-quantized model (fused Q/K/V and gate/up included)."""
    model = tiny_qwen3()
    outputs = greedy(engine(model, "fp8"))
    assert logprob_gap(fake_quantized(model), outputs) < 1e-5
    assert logprob_gap(model, outputs) > 1e-2  # and the quantization shows


def test_fp8_engine_log_probs_are_close_to_the_bf16_forward() -> None:
    model = build("qwen3").to(torch.bfloat16).eval()  # initialised at HF's scale (std 0.02)
    fp8_out, bf16_out = greedy(engine(model, "fp8")), greedy(engine(model))
    assert all(len(o.output_ids) == NEW_TOKENS for o in fp8_out)
    fp8_gap, bf16_gap = logprob_gap(model, fp8_out), logprob_gap(model, bf16_out)
    print(
        f"mean |log-prob diff| vs the bf16 forward: fp8 engine {fp8_gap:.4f}, bf16 {bf16_gap:.4f}"
    )
    assert bf16_gap < fp8_gap < 0.02


def perturbed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        name: p.detach() + 0.5 * p.detach().std() * torch.randn(p.shape, generator=gen).to(p)
        for name, p in model.named_parameters()
        if name.endswith(("q_proj.weight", "down_proj.weight", "gate_proj.weight"))
    }


def test_every_weight_update_quantizes_again() -> None:
    """After an update (tensors copied in; or written in place with a version bump, as a
    zero-copy colocated one is), the fp8 engine generates what an fp8 engine started on the new
    weights does."""
    model = tiny_qwen3()
    scheduler = engine(model, "fp8")
    before = [o.output_token_logprobs for o in greedy(scheduler)]
    new = perturbed(model)
    scheduler.update_weights_from_tensors(list(new.items()), 1)
    updated = copy.deepcopy(model)
    after = [o.output_token_logprobs for o in greedy(scheduler)]
    assert after != before
    assert after == [o.output_token_logprobs for o in greedy(engine(updated, "fp8"))]
    with torch.no_grad():  # in place, then only the version: the zero-copy path
        for name, p in model.named_parameters():
            if name in new:
                p.mul_(-1.0)
    scheduler.flush_cache()  # as the sync protocol does; the fp8 copies are the version's
    scheduler.set_weight_version(2)
    negated = [o.output_token_logprobs for o in greedy(scheduler)]
    assert negated == [o.output_token_logprobs for o in greedy(engine(copy.deepcopy(model), "fp8"))]


def test_released_weights_include_the_fp8_copies() -> None:
    model = tiny_qwen3()
    scheduler = engine(model, "fp8")
    want = [o.output_ids for o in greedy(scheduler)]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    quantized = scheduler.runner.quantized_tensors()
    assert quantized
    freed = scheduler.memory.release(["weights"])
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert freed == param_bytes + sum(t.numel() * t.element_size() for t in quantized)
    scheduler.memory.resume(["weights"])
    scheduler.update_weights_from_tensors(list(params.items()), 1)
    assert [o.output_ids for o in greedy(scheduler)] == want


def test_models_fp8_cannot_run_are_refused_naming_why() -> None:
    torch.manual_seed(0)
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=16, **COMMON))
    with pytest.raises(ValueError, match="does not read 'gemma' models"):
        ModelRunner(gemma, tiny_qwen3_pool(torch.float32), quantization="fp8")
    odd = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(head_dim=16, **{**COMMON, "intermediate_size": 72})
    )
    with pytest.raises(ValueError, match=r"multiples of 16.*0\.down is \[64, 72\]"):
        ModelRunner(odd, tiny_qwen3_pool(torch.float32), quantization="fp8")
    with pytest.raises(ValueError, match="bit for bit"):
        ModelRunner(
            tiny_qwen3(), tiny_qwen3_pool(torch.float32), quantization="fp8", true_on_policy=True
        )


def test_lean_families_are_the_ones_the_lean_forward_reads() -> None:
    for family in FAMILIES:
        model = build_tiny_model(
            TinyModelConfig(family=family, num_layers=1), vocab_size=100, seed=0
        )
        assert readable(model) == (family in LEAN_FAMILIES), family


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["trainer.true_on_policy=true"], "trainer.true_on_policy"),
        (["model.tiny={family: qwen3-moe}"], "model.tiny.family=qwen3-moe"),
        (["trainer.device=cuda", "trainer.dtype=float32"], "trainer.dtype=float32 on CUDA"),
    ],
)
def test_config_refuses_what_fp8_cannot_run(overrides: list[str], reason: str) -> None:
    with pytest.raises(ConfigError, match=f"engine.quantization=fp8 does not work with {reason}"):
        load_config(None, ["engine.quantization=fp8", *overrides])


def test_help_describes_the_option() -> None:
    assert "engine.quantization" in help_text() and "torch._scaled_mm" in help_text()


TINY_RUN = [
    "num_steps=2",
    "trainer.device=cpu",
    "num_threads=1",
    "model.tiny={hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2, "
    "intermediate_size: 128, max_position_embeddings: 32}",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "trainer.lr=1e-2",
    "loss.entropy_coef=0.1",
    "loss.use_tis=true",
]


@pytest.mark.parametrize("engines", ["embedded", "in_process", "processes"])
def test_a_train_run_with_fp8_engines_and_tis_logs_the_gap(tmp_path: Path, engines: str) -> None:
    run_dir = tmp_path / "run"
    args = [*TINY_RUN, "engine.quantization=fp8", f"placement.engines={engines}"]
    assert main(["train", *args, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/grad_norm" in r]
    assert len(steps) == 2
    for row in steps:
        # fp8 rollout, fp32 training: a gap (fp32 engines leave ~1e-7), small, TIS weighs it
        assert 1e-3 < row["train/train_rollout_logprob_abs_diff"] < 0.1
        assert "train/tis_mean" in row
