"""FP8 rollout on CUDA (sm89+): the Triton activation quantization bit-equal to PyTorch's,
cuBLAS's row-wise fp8 GEMM within the error of its quantized inputs, the fp8 engine (decode CUDA
graphs on) close to the bf16 forward and equal to itself without graphs, and a weight update,
copied in or written in place, quantized again into the memory the captured graphs read."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_qwen3
from tests.gpu.test_engine_cuda import pool
from tests.test_fp8_rollout import NEW_TOKENS, greedy, logprob_gap, perturbed
from tests.test_lean_decoder import build
from verst.engine.kernels.fp8_linear import (
    Fp8Weight,
    fp8_linear,
    max_error,
    quantize_rows,
    quantize_rows_triton,
)
from verst.engine.paged_attention import triton
from verst.engine.scheduler import Scheduler

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton is None or torch.cuda.get_device_capability() < (8, 9),
    reason="needs CUDA with fp8 tensor cores (sm89+) and Triton",
)


def engine(model: torch.nn.Module, quantization: str = "fp8", **kw) -> Scheduler:
    return Scheduler(
        model, pool(), eos_token_ids=[], pad_token_id=0, quantization=quantization, **kw
    )


def ids(outputs) -> list[list[int]]:
    return [o.output_ids for o in outputs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("depth", [64, 896, 4864])
def test_the_triton_quantization_equals_pytorchs(dtype, depth) -> None:
    """One kernel, the same bits: amax, IEEE divisions, round to nearest even."""
    torch.manual_seed(0)
    x = (torch.randn(33, 2 * depth, device="cuda") * 3).to(dtype)[:, ::2]  # strided rows
    x[5] = 0.0
    x[7] *= 1e-6
    q, scale = quantize_rows_triton(x)
    want_q, want_scale = quantize_rows(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize(("rows", "depth", "width"), [(1, 896, 4864), (64, 4864, 896)])
def test_cuda_fp8_linear_is_within_the_error_its_inputs_carry(rows, depth, width) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, depth, device="cuda").bfloat16()
    w = (torch.randn(width, depth, device="cuda") / depth**0.5).bfloat16()
    got = fp8_linear(x, Fp8Weight.of(w)).float()
    exact = x.float() @ w.float().T
    dx, dw = max_error(x), max_error(w)
    bound = dx @ w.float().abs().T + x.float().abs() @ dw.T + dx @ dw.T
    bound += exact.abs() * torch.finfo(torch.bfloat16).eps + 1e-3
    assert ((got - exact).abs() <= bound).all()


def test_fp8_engine_generates_close_to_the_bf16_forward() -> None:
    model = build("qwen3").to("cuda", torch.bfloat16).eval()  # HF's initial scale
    scheduler = engine(model)
    outputs = greedy(scheduler)
    assert scheduler.runner._graphs, "decode ran without CUDA graphs"
    assert all(len(o.output_ids) == NEW_TOKENS for o in outputs)
    fp8_gap = logprob_gap(model, outputs)
    bf16_gap = logprob_gap(model, greedy(engine(model, "none")))
    print(f"mean |log-prob diff| vs the bf16 forward: fp8 {fp8_gap:.4f}, bf16 {bf16_gap:.4f}")
    assert bf16_gap < fp8_gap < 0.02


def test_graphs_and_eager_decode_agree() -> None:
    model = tiny_qwen3().to("cuda", torch.bfloat16)  # peaked: no near-ties among greedy tokens
    graphed, eager = greedy(engine(model)), greedy(engine(model, cuda_graphs=False))
    assert ids(graphed) == ids(eager)
    for a, b in zip(graphed, eager, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.output_token_logprobs),
            torch.tensor(b.output_token_logprobs),
            atol=1e-2,
            rtol=0,
        )


def test_weight_updates_reach_the_fp8_copies_the_graphs_read() -> None:
    model = tiny_qwen3().to("cuda", torch.bfloat16)
    scheduler = engine(model)
    before = greedy(scheduler)
    assert scheduler.runner._graphs
    new = perturbed(model)
    scheduler.update_weights_from_tensors(list(new.items()), 1)
    after = greedy(scheduler)
    assert ids(after) != ids(before)
    assert ids(after) == ids(greedy(engine(copy.deepcopy(model))))
    with torch.no_grad():  # written in place, then only the version (zero-copy colocated)
        for name, p in model.named_parameters():
            if name in new:
                p.mul_(-1.0)
    scheduler.flush_cache()
    scheduler.set_weight_version(2)
    assert ids(greedy(scheduler)) == ids(greedy(engine(copy.deepcopy(model))))


def test_an_fp32_engine_on_cuda_is_refused() -> None:
    model = tiny_qwen3().to("cuda")
    with pytest.raises(ValueError, match="writes bf16"):
        Scheduler(model, pool(torch.float32), eos_token_ids=[], pad_token_id=0, quantization="fp8")
