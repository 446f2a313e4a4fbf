"""True on-policy mode on CUDA: the invariant ops at real model sizes, the CPU tests' op and
forward checks run on the GPU, and `verst train` with a train-rollout log-prob difference of
exactly 0 in bf16, dense and MoE, sync and fully async."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import test_batch_invariant as cpu_tests
from tests.test_true_on_policy import RUN, check_logprobs_equal_the_trainers, engine, records
from verst.cli import main
from verst.models import batch_invariant as bi
from verst.models.invariant_cuda import matmul

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("depth", "width"), [(896, 4864), (4864, 896), (896, 151936)])
def test_linear_rows_at_model_sizes(dtype, depth, width):
    """cuBLAS changes kernels with the row count at these sizes; the invariant GEMM does not."""
    torch.manual_seed(0)
    weight = (torch.randn(width, depth, device="cuda") / depth**0.5).to(dtype)
    x = torch.randn(1000, depth, device="cuda").to(dtype)
    whole = bi.linear(x, weight)
    for rows in (1, 2, 3, 16, 17, 64, 200):
        assert torch.equal(bi.linear(x[:rows], weight), whole[:rows])
    assert torch.equal(bi.linear(x[500:503], weight), whole[500:503])
    assert (whole.float() - x.float() @ weight.float().t()).abs().max() < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_sums_at_model_sizes(dtype):
    torch.manual_seed(0)
    x = torch.randn(3000, 4096, device="cuda").to(dtype)
    weight = torch.randn(4096, device="cuda").to(dtype)
    norms, sums = bi.rms_norm(x, weight, 1e-6), bi.row_sum(x.float())
    for rows in (slice(0, 1), slice(7, 10), slice(0, 300)):
        assert torch.equal(bi.rms_norm(x[rows], weight, 1e-6), norms[rows])
        assert torch.equal(bi.row_sum(x[rows].float()), sums[rows])


def test_sampler_log_softmax_at_vocab_size():
    torch.manual_seed(0)
    z = torch.randn(2000, 151936, device="cuda") * 5
    whole = torch.log_softmax(z, dim=-1)
    for rows in (slice(0, 1), slice(5, 8), slice(0, 64)):
        assert torch.equal(torch.log_softmax(z[rows], dim=-1), whole[rows])


def test_the_invariant_gemm_has_gradients():
    torch.manual_seed(0)
    a = torch.randn(2, 3, 20, 40, device="cuda", requires_grad=True)
    b = torch.randn(40, 24, device="cuda", requires_grad=True)
    matmul(a, b).square().sum().backward()
    a_ref, b_ref = a.detach().requires_grad_(), b.detach().requires_grad_()
    torch.matmul(a_ref, b_ref).square().sum().backward()
    assert torch.allclose(a.grad, a_ref.grad, rtol=1e-4, atol=1e-4)
    assert torch.allclose(b.grad, b_ref.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "check",
    [
        lambda: [cpu_tests.test_linear_rows_do_not_depend_on_the_batch(d) for d in DTYPES],
        lambda: [
            cpu_tests.check_attention(d, D, 37, range(37), extra)
            for d in DTYPES
            for D in (32, 64)
            for extra in (0, 40)
        ],
        cpu_tests.test_attention_over_long_sequences,
    ],
    ids=["linear", "attention", "long_attention"],
)
def test_the_cpu_op_checks_hold_on_cuda(check):
    with torch.device("cuda"):
        check()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "qwen3-moe"])
def test_forward_incremental_equals_whole_sequence_on_cuda(family, dtype):
    with torch.device("cuda"):
        cpu_tests.test_forward_incremental_equals_whole_sequence(family, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_replays_invariant_decode_graphs_with_the_trainers_logprobs(dtype):
    """The invariant decode replays CUDA graphs (one per batch bucket and span of pages),
    reading every key of its span: the log-probs stay the trainer's, bitwise."""
    with torch.device("cuda"):
        model = cpu_tests.tiny("qwen3", dtype)
    for max_running in (8, 1):
        scheduler = engine(model, max_running)
        check_logprobs_equal_the_trainers(model, scheduler)
        spans = {span for _, _, span in scheduler.runner._graphs}
        assert scheduler.runner.cuda_graphs and len(spans) >= 2, spans


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.tiny.family=qwen3-moe", "model.tiny.num_experts=4"],
        [
            "mode=fully_async",
            "placement.mode=disaggregated",
            "placement.engines=processes",
            "placement.engine_devices=[cuda:0]",
            "sync.transport=disk",  # NCCL cannot join two ranks on one GPU
            "rollout.max_staleness=0",
        ],
    ],
    ids=["sync", "sync_moe", "fully_async"],
)
def test_train_logprob_diff_is_exactly_zero_in_bf16_on_cuda(tmp_path: Path, overrides):
    run_dir = tmp_path / "run"
    cuda_run = [o for o in RUN if o != "trainer.device=cpu"] + ["trainer.device=cuda"]
    args = [*cuda_run, "trainer.dtype=bfloat16", *overrides]
    assert main(["train", *args, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert len(rows) == 3
    for row in rows:
        assert row["train/train_rollout_logprob_abs_diff"] == 0.0
        assert row["train/grad_norm"] > 0
