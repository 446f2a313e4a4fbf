"""The CPU engine's C kernels compute what PyTorch's ops compute (bf16 norms and rotary bit for
bit), and the engine's output is the same with them or without."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_qwen3, tiny_qwen3_pool
from verst.engine import GenerateRequest, SamplingParams
from verst.engine.kernels.cpu import load
from verst.engine.model_runner import ModelRunner, Row
from verst.engine.paged_attention import paged_decode_reference
from verst.engine.scheduler import Scheduler

KERNELS = load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler to build the kernels")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 200, dtype=dtype) * 3
    weight = torch.randn(200, dtype=dtype)
    got = KERNELS.rms_norm(x, weight, 1e-6)
    want = hf_rms_norm(x, weight, 1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    strided = x[:, 1]  # rows with a stride
    assert torch.equal(KERNELS.rms_norm(strided, weight, 1e-6), got[:, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_hf_residual_add_then_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    x = torch.randn(4, 3, 200, dtype=dtype)[:, 1]  # strided rows
    residual = torch.randn(4, 200, dtype=dtype) * 2
    weight = torch.randn(200, dtype=dtype)
    total, normed = KERNELS.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, residual + x)
    want = hf_rms_norm(residual + x, weight, 1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(normed, want)
    else:
        torch.testing.assert_close(normed, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_rope_matches_hf(dtype: torch.dtype, with_norm: bool) -> None:
    torch.manual_seed(1)
    fused = torch.randn(7, (4 + 2 + 2) * 32, dtype=dtype)  # one row of q | k | v per token
    q = fused[:, : 4 * 32].view(7, 4, 32)  # strided rows, dense heads
    weight = torch.randn(32, dtype=dtype) if with_norm else None
    cos, sin = torch.randn(7, 32).to(dtype), torch.randn(7, 32).to(dtype)
    got = KERNELS.norm_rope(q, weight, 1e-6, cos, sin)
    normed = hf_rms_norm(q, weight, 1e-6) if weight is not None else q
    want = hf_rotary(normed, cos[:, None], sin[:, None])
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_attention_over_gathered_pages(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    k_pages = torch.randn(30, 4, 2, 16, dtype=dtype)
    v_pages = torch.randn(30, 4, 2, 16, dtype=dtype)
    table = torch.randperm(30)[:20].view(4, 5)
    seq_lens = torch.tensor([1, 4, 9, 20])  # one token, a full page, part pages, every page
    q = torch.randn(4, 6, 16, dtype=dtype)  # 3 query heads per KV head
    got = KERNELS.paged_decode(q, k_pages, v_pages, table, seq_lens, 0.25)
    want = paged_decode_reference(q, k_pages, v_pages, table, seq_lens, 0.25)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_bad_inputs_are_refused() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="one dtype"):
        KERNELS.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        KERNELS.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="dense"):
        q = torch.randn(3, 8, 4).transpose(1, 2)
        KERNELS.norm_rope(q, None, 0.0, torch.randn(3, 8), torch.randn(3, 8))


def test_greedy_output_is_the_same_with_or_without_kernels() -> None:
    model = tiny_qwen3()
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 7 + j * 3) % 60 + 1 for j in range(4 + 3 * i)] for i in range(4)]

    def outputs(kernels: bool) -> tuple[list[list[int]], Scheduler]:
        scheduler = Scheduler(
            model,
            tiny_qwen3_pool(torch.float32),
            eos_token_ids=[],
            pad_token_id=0,
            fused_kernels=kernels,
        )
        requests = [GenerateRequest(input_ids=p, sampling_params=params) for p in prompts]
        return [d.output_ids for d in scheduler.generate(requests)], scheduler

    with_kernels, scheduler = outputs(True)
    assert scheduler.runner.kernels is not None
    without, plain = outputs(False)
    assert plain.runner.kernels is None
    assert with_kernels == without


@pytest.mark.parametrize("lean", [True, False])
def test_bf16_decode_logits_are_close_with_or_without_kernels(lean: bool) -> None:
    # bf16 argmax of a random tiny model flips on last-bit differences, so compare logits
    model = tiny_qwen3().to(torch.bfloat16)
    prompts = [[5, 9, 14, 3, 7, 21, 8], [40, 2, 11]]
    pages = [[1, 2], [7]]

    def decode_logits(kernels: bool) -> torch.Tensor:
        runner = ModelRunner(
            model, tiny_qwen3_pool(torch.bfloat16), lean=lean, fused_kernels=kernels
        )
        assert (runner.kernels is not None) == kernels
        runner.forward(
            [Row(tokens=p, past=0, pages=pg) for p, pg in zip(prompts, pages, strict=True)]
        )
        last, _ = runner.forward(
            [Row(tokens=[17], past=len(p), pages=pg) for p, pg in zip(prompts, pages, strict=True)]
        )
        return last

    torch.testing.assert_close(decode_logits(True), decode_logits(False), atol=3e-2, rtol=3e-2)
