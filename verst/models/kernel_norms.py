"""RMSNorm and per-head norm + rotary through the CPU engine's C kernels, differentiable.

True on-policy mode needs the engine and the trainer to compute the same bits. PyTorch runs a
norm as six ops and rotary as seven (each its own pass and allocation), which on the CPU cost
the engine's invariant forward a seventh of its time. The C kernels
(`verst/engine/kernels/csrc/cpu_kernels.c`) compute each row alone, in one pass, from a copy
of the row in a local buffer: what a row gives does not depend on the other rows of the call,
their number, or where the row lies in memory (tests/test_batch_invariant.py checks). So both
sides can run them: the forward is the kernel; the backward differentiates the same formula in
PyTorch's ops (`torch_rms_norm`, `torch_norm_rotary`), whose gradient is the kernel's up to
rounding. Where the kernels cannot run (no C compiler, `VERST_CPU_KERNELS=0`, CUDA, mixed
dtypes, rows past their buffers), both sides run PyTorch's ops: the same inputs decide it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# the C source's stack buffers and dtypes (`verst.engine.kernels.cpu`)
MAX_ROW, MAX_HEAD = 16384, 1024
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def cpu_kernels() -> Any:
    """The C kernels, or None where they cannot be built (loaded once a process)."""
    from verst.engine.kernels.cpu import load  # the engine's loader; built at first use

    return load()


def torch_rms_norm(x_N_E: torch.Tensor, weight_E: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama / Qwen RMSNorm in PyTorch's ops: in fp32, rounded to x's dtype, times weight."""
    xf_N_E = x_N_E.float()
    normed_N_E = xf_N_E * torch.rsqrt(xf_N_E.pow(2).mean(-1, keepdim=True) + eps)
    return weight_E * normed_N_E.to(x_N_E.dtype)


def torch_norm_rotary(
    x_B_T_H_D: torch.Tensor,
    norm: tuple[torch.Tensor, float] | None,
    cos_B_T_D: torch.Tensor,
    sin_B_T_D: torch.Tensor,
) -> torch.Tensor:
    """The per-head norm (`norm`: weight, eps; Qwen3's), then HF's x·cos + rotate_half(x)·sin."""
    if norm is not None:
        x_B_T_H_D = torch_rms_norm(x_B_T_H_D, *norm)
    half = x_B_T_H_D.shape[-1] // 2
    rotated = torch.cat([-x_B_T_H_D[..., half:], x_B_T_H_D[..., :half]], dim=-1)
    return x_B_T_H_D * cos_B_T_D[:, :, None] + rotated * sin_B_T_D[:, :, None]


def kernel_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm through the C kernel (differentiable), or None where it cannot run."""
    if not _runs(x, weight) or x.shape[-1] > MAX_ROW:
        return None
    return _RmsNorm.apply(x, weight, eps)


def kernel_norm_rotary(
    x_B_T_H_D: torch.Tensor,
    norm: tuple[torch.Tensor, float] | None,
    cos_B_T_D: torch.Tensor,
    sin_B_T_D: torch.Tensor,
) -> torch.Tensor | None:
    """`torch_norm_rotary` through the C kernel (differentiable), or None where it cannot run."""
    weight, eps = norm if norm is not None else (None, 0.0)
    D = x_B_T_H_D.shape[-1]
    tensors = [t for t in (x_B_T_H_D, weight, cos_B_T_D, sin_B_T_D) if t is not None]
    if not _runs(*tensors) or D > MAX_HEAD or D % 8:
        return None
    return _NormRotary.apply(x_B_T_H_D, weight, eps, cos_B_T_D, sin_B_T_D)


def _runs(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    if dtype not in DTYPES or any(t.is_cuda or t.dtype != dtype for t in tensors):
        return False
    return cpu_kernels() is not None


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return cpu_kernels().rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grads = _grads(ctx, lambda x, w: torch_rms_norm(x, w, ctx.eps), (x, weight), grad)
        return (*grads, None)


class _NormRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, cos, sin) -> torch.Tensor:
        B, T, H, D = x.shape
        ctx.save_for_backward(x, weight, cos, sin)
        ctx.eps = eps
        out = cpu_kernels().norm_rope(
            x.reshape(B * T, H, D),
            weight,
            eps,
            cos.reshape(B * T, D).contiguous(),
            sin.reshape(B * T, D).contiguous(),
        )
        return out.view(B, T, H, D)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, cos, sin = ctx.saved_tensors

        def formula(x, *weight):
            norm = (weight[0], ctx.eps) if weight else None
            return torch_norm_rotary(x, norm, cos, sin)

        inputs = (x,) if weight is None else (x, weight)
        grads = _grads(ctx, formula, inputs, grad)
        return grads[0], grads[1] if weight is not None else None, None, None, None


def _grads(ctx, formula, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor) -> list:
    """d formula(inputs) · grad for the inputs autograd asks about (None for the others)."""
    wanted = [
        t.detach().requires_grad_(need)
        for t, need in zip(inputs, ctx.needs_input_grad, strict=False)
    ]
    with torch.enable_grad():
        out = formula(*wanted)
    asked = [t for t in wanted if t.requires_grad]
    found = iter(torch.autograd.grad(out, asked, grad) if asked else ())
    return [next(found) if t.requires_grad else None for t in wanted]
