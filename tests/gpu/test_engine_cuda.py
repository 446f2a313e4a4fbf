"""The scheduler on CUDA: Triton paged decode kernel, CUDA-graph decode, exact against HF."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.conftest import tiny_qwen3
from verst.engine import GenerateRequest, SamplingParams
from verst.engine.kernels.fused_norm import fusable_norms, rms_norm_triton
from verst.engine.kernels.paged_decode import paged_decode_triton
from verst.engine.kv_pool import KVPool
from verst.engine.paged_attention import paged_decode_reference, triton
from verst.engine.scheduler import Scheduler

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton"
)


def tiny_model(dtype: torch.dtype) -> transformers.Qwen3ForCausalLM:
    return tiny_qwen3().to("cuda", dtype)


def pool(dtype: torch.dtype = torch.bfloat16) -> KVPool:
    """Shaped for `tiny_qwen3` and `build("qwen3")` alike: 2 layers, 2 KV heads of 16."""
    return KVPool(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        num_pages=256,
        dtype=dtype,
        device="cuda",
    )


def scheduler(model, dtype, **kw) -> Scheduler:
    return Scheduler(model, pool(dtype), eos_token_ids=[63], pad_token_id=0, **kw)


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "page"), [(14, 2, 64, 16), (4, 2, 16, 4), (16, 8, 128, 16)]
)
def test_triton_decode_kernel_matches_reference(hq, hkv, d, page) -> None:
    torch.manual_seed(0)
    k = torch.randn(50, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randint(0, 50, (5, 20), device="cuda")
    seq = torch.tensor([1, 17, 64, 200, 20 * page], device="cuda").clamp(max=20 * page)
    q = torch.randn(5, hq, d, device="cuda", dtype=torch.bfloat16)
    out = paged_decode_triton(q, k, v, table, seq, d**-0.5)
    torch.testing.assert_close(
        out.float(), paged_decode_reference(q, k, v, table, seq, d**-0.5).float(), atol=2e-2, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 896), (2, 7, 14, 64), (1, 1, 100)])
def test_fused_rms_norm_matches_hf(dtype, shape) -> None:
    norm = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(shape[-1], eps=1e-6)
    norm = norm.to("cuda", dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.normal_()
        x = torch.randn(shape, device="cuda", dtype=dtype) * 3
        expected, fused = norm(x), rms_norm_triton(x, norm.weight, norm.variance_epsilon)
    assert fused.dtype == expected.dtype and fused.shape == expected.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fused, expected, atol=tolerance, rtol=tolerance)


def test_the_engine_fuses_every_norm_of_qwen3() -> None:
    model = tiny_model(torch.float32)
    layers = model.config.num_hidden_layers
    assert len(fusable_norms(model)) == 4 * layers + 1  # input, post, q, k; the final norm


@pytest.mark.parametrize(("graphs", "lean"), [(True, True), (False, True), (True, False)])
def test_greedy_equals_hf_generate_fp32_on_cuda(graphs, lean) -> None:
    model = tiny_model(torch.float32)
    prompts = [[(i * 7 + j * 3) % 60 + 1 for j in range(n)] for i, n in enumerate([5, 11, 2, 30])]
    sched = scheduler(model, torch.float32, cuda_graphs=graphs, lean_forward=lean)
    assert (sched.runner.lean is not None) == lean
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = sched.generate([GenerateRequest(input_ids=p, sampling_params=params) for p in prompts])
    assert (len(sched.runner._graphs) > 0) == graphs
    for p, out in zip(prompts, outs, strict=True):
        expected = model.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        assert out.output_ids == expected


def test_logprobs_equal_full_forward_with_graphs() -> None:
    model = tiny_model(torch.float32)
    sched = scheduler(model, torch.float32)
    p = [3, 9, 27, 17, 51, 25, 11, 33, 2]
    reqs = [
        GenerateRequest(
            input_ids=p, sampling_params=SamplingParams(max_new_tokens=20, ignore_eos=True)
        )
        for _ in range(3)
    ]
    for out in sched.generate(reqs):
        with torch.no_grad():
            logits = model(torch.tensor([p + out.output_ids], device="cuda")).logits[
                0, len(p) - 1 : -1
            ]
        expected = torch.log_softmax(logits.float(), -1).gather(
            -1, torch.tensor(out.output_ids, device="cuda")[:, None]
        )[:, 0]
        torch.testing.assert_close(
            torch.tensor(out.output_token_logprobs, device="cuda"), expected, atol=1e-4, rtol=0
        )


def test_weight_update_reaches_the_captured_graphs() -> None:
    model = tiny_model(torch.float32)
    sched = scheduler(model, torch.float32)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    before = sched.generate([GenerateRequest(input_ids=[5, 6, 7], sampling_params=params)])[0]
    new = {n: torch.randn_like(t) * 0.2 for n, t in model.named_parameters()}
    sched.update_weights_from_tensors(new.items(), version=3)
    after = sched.generate([GenerateRequest(input_ids=[5, 6, 7], sampling_params=params)])[0]
    expected = model.generate(
        torch.tensor([[5, 6, 7]], device="cuda"),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, 3:].tolist()
    assert after.output_ids == expected and after.weight_version == 3
    assert after.output_ids != before.output_ids


def test_lean_forward_in_bf16_is_as_accurate_as_hf_forward_on_cuda() -> None:
    # bf16 noise grows through the layers, differently for two correct computations: compare
    # each with the float32 forward instead of with each other
    from verst.engine.model_runner import Row

    prompts = [[5, 9, 14, 3, 7, 21, 8], [40, 2, 11]]
    pages = [[1, 2], [7]]

    def logits(dtype: torch.dtype, lean: bool) -> torch.Tensor:
        runner = scheduler(tiny_model(dtype), dtype, lean_forward=lean).runner
        rows = [
            Row(tokens=p, past=0, pages=pg, all_logits=True)
            for p, pg in zip(prompts, pages, strict=True)
        ]
        _, full = runner.forward(rows)
        last, _ = runner.forward(
            [Row(tokens=[17], past=len(p), pages=pg) for p, pg in zip(prompts, pages, strict=True)]
        )
        return torch.cat([full[0], full[1], last]).float()

    reference = logits(torch.float32, lean=False)
    lean_error = (logits(torch.bfloat16, lean=True) - reference).abs().max()
    hf_error = (logits(torch.bfloat16, lean=False) - reference).abs().max()
    assert lean_error <= 1.5 * hf_error + 1e-2, (lean_error, hf_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_rope_kernel_matches_hf(dtype, with_norm) -> None:
    from verst.engine.kernels.cuda import CudaKernels

    torch.manual_seed(0)
    fused = torch.randn(9, (4 + 2 + 2) * 64, device="cuda", dtype=dtype) * 2
    q = fused[:, : 4 * 64].view(9, 4, 64)  # strided rows, as split from a fused projection
    norm = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(64).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.normal_()
    cos = torch.randn(9, 64, device="cuda").to(dtype)
    sin = torch.randn(9, 64, device="cuda").to(dtype)
    got = CudaKernels().norm_rope(q, norm.weight if with_norm else None, 1e-6, cos, sin)
    with torch.no_grad():
        x = norm(q) if with_norm else q
    rotated = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)
    want = x * cos[:, None] + rotated * sin[:, None]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_matches_torch(dtype) -> None:
    from verst.engine.kernels.cuda import CudaKernels

    torch.manual_seed(0)
    fused = torch.randn(5, 2 * 1500, device="cuda", dtype=dtype) * 3
    gate, up = fused[:, :1500], fused[:, 1500:]
    got = CudaKernels().silu_mul(gate, up)
    want = torch.nn.functional.silu(gate) * up
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_the_lean_forward_uses_the_cuda_kernels() -> None:
    from verst.engine.kernels.cuda import CudaKernels

    sched = scheduler(tiny_model(torch.bfloat16), torch.bfloat16)
    assert isinstance(sched.runner.kernels, CudaKernels)
    assert sched.runner.lean is not None and sched.runner.lean.kernels is sched.runner.kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_kernel_matches_hf(dtype) -> None:
    from verst.engine.kernels.cuda import CudaKernels

    torch.manual_seed(0)
    x = torch.randn(6, 3, 896, device="cuda", dtype=dtype)[:, 1]
    residual = torch.randn(6, 896, device="cuda", dtype=dtype) * 2
    norm = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(896).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.normal_()
        total, normed = CudaKernels().add_rms_norm(x, residual, norm.weight, 1e-6)
        want = norm(residual + x)
    assert torch.equal(total, residual + x)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(normed, want, atol=tolerance, rtol=tolerance)


def test_fused_projections_follow_updates_and_re_pointed_parameters() -> None:
    """Q/K/V and gate/up run as one GEMM each on CUDA (`OneBuffer`); a weight update written
    in place reaches them, and a parameter re-pointed at other storage (as a zero-copy share of
    the trainer's does) makes that group run apart, on the new storage."""
    model = tiny_model(torch.float32)
    sched = scheduler(model, torch.float32)
    lean = sched.runner.lean
    assert lean is not None and all(
        layer.qkv.one_buffer is not None and layer.gate_up.one_buffer is not None
        for layer in lean.layers
    )
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

    def greedy() -> list[int]:
        request = GenerateRequest(input_ids=[5, 6, 7], sampling_params=params)
        return sched.generate([request])[0].output_ids

    def hf() -> list[int]:
        out = model.generate(
            torch.tensor([[5, 6, 7]], device="cuda"),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[0, 3:].tolist()

    assert greedy() == hf()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.data = attn.k_proj.weight.detach().clone() * 3  # re-pointed
    sched.flush_cache()
    sched.runner.drop_graphs()  # the graphs read the old buffer's K rows by address
    assert not lean.layers[0].qkv.one_buffer.intact() and lean.layers[1].qkv.one_buffer.intact()
    assert greedy() == hf()


def test_prefill_attention_avoids_cudnn_plans() -> None:
    """A prefix-cache hit's prefill attends through SDPA with a mask; cuDNN's backend would build
    a plan for every new length (`SHAPE_FREE_SDPA`)."""
    from torch.profiler import ProfilerActivity, profile

    sched = scheduler(tiny_model(torch.bfloat16), torch.bfloat16)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, 30))
    sched.generate([GenerateRequest(input_ids=prompt, sampling_params=params)])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = sched.generate(
            [GenerateRequest(input_ids=prompt + [7, 8, 9], sampling_params=params)]
        )
    assert out[0].cached_tokens > 0
    names = [e.key for e in prof.key_averages()]
    assert any("scaled_dot_product" in n for n in names)
    assert not any("cudnn" in n.lower() for n in names), names
