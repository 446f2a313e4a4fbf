"""The C kernels' RMSNorm and norm + rotary as true on-policy mode runs them on both sides:
each row alone (whatever shares the call, wherever it lies in memory) and differentiable."""

from __future__ import annotations

import pytest
import torch

from verst.models import kernel_norms
from verst.models.kernel_norms import (
    cpu_kernels,
    kernel_norm_rotary,
    kernel_rms_norm,
    torch_norm_rotary,
    torch_rms_norm,
)

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs the C kernels (a compiler)")


def tables(B: int, T: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(B * T * D, dtype=torch.float32).view(B, T, D) * 0.37
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rows_are_alike_alone_in_any_batch_and_at_any_offset(dtype) -> None:
    torch.manual_seed(0)
    weight = torch.randn(896, dtype=dtype)
    buffer = torch.randn(1 + 37 * 896, dtype=dtype) * 3
    batch = buffer[1:].view(37, 896)  # rows 4 bytes (2 in bf16) past any alignment
    together = kernel_rms_norm(batch, weight, 1e-6)
    for r in (0, 5, 36):
        alone = kernel_rms_norm(batch[r : r + 1].clone(), weight, 1e-6)
        assert torch.equal(alone[0], together[r])
    assert torch.equal(kernel_rms_norm(batch[3:20], weight, 1e-6), together[3:20])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    want = torch_rms_norm(batch, weight, 1e-6)
    torch.testing.assert_close(together, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_rotary_rows_are_alike_alone_in_any_batch(dtype, with_norm) -> None:
    torch.manual_seed(0)
    B, T, H, D = 3, 5, 4, 64
    x = torch.randn(B, T, H, D, dtype=dtype)
    cos, sin = tables(B, T, D, dtype)
    norm = (torch.randn(D, dtype=dtype), 1e-6) if with_norm else None
    together = kernel_norm_rotary(x, norm, cos, sin)
    alone = kernel_norm_rotary(x[1:2, 2:3].clone(), norm, cos[1:2, 2:3], sin[1:2, 2:3])
    assert torch.equal(alone[0, 0], together[1, 2])
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    want = torch_norm_rotary(x, norm, cos, sin)
    torch.testing.assert_close(together, want, atol=tolerance, rtol=tolerance)


def test_gradients_are_the_formulas() -> None:
    torch.manual_seed(0)
    B, T, H, D = 2, 3, 2, 16
    x = torch.randn(B, T, H, D, requires_grad=True)
    w = torch.randn(D, requires_grad=True)
    cos, sin = tables(B, T, D, torch.float32)
    upstream = torch.randn(B, T, H, D)
    (kernel_norm_rotary(x, (w, 1e-6), cos, sin) * upstream).sum().backward()
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (torch_norm_rotary(x, (w, 1e-6), cos, sin) * upstream).sum().backward()
    for g, want in zip(got, (x.grad, w.grad), strict=True):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    y, v = torch.randn(4, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    (kernel_rms_norm(y, v, 1e-6) * upstream.view(4, -1)[:, :32]).sum().backward()
    got = y.grad.clone(), v.grad.clone()
    y.grad = v.grad = None
    (torch_rms_norm(y, v, 1e-6) * upstream.view(4, -1)[:, :32]).sum().backward()
    for g, want in zip(got, (y.grad, v.grad), strict=True):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)


def test_without_the_kernels_both_sides_run_pytorch(monkeypatch) -> None:
    monkeypatch.setattr(kernel_norms, "cpu_kernels", lambda: None)
    x = torch.randn(2, 8)
    assert kernel_rms_norm(x, torch.ones(8), 1e-6) is None
    assert kernel_rms_norm(x.double(), torch.ones(8).double(), 1e-6) is None
