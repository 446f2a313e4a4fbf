"""RMSNorm as one Triton kernel, swapped into the model's norms while the engine runs a forward.

HF's RMSNorm is half a dozen elementwise kernels (cast, square, mean, rsqrt, two multiplies); a
decoder layer of Qwen3 has four of them, so at small batches the engine's decode step is mostly
kernel launches. `fused_norms(modules)` replaces each listed module's `forward` with one kernel
for the duration of a forward (the model is left as it was: a trainer sharing it keeps HF's).
The kernel follows HF's order of operations: float32 statistics, normalise, cast back to the
input dtype, then multiply by the weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from verst.engine.paged_attention import triton

if triton is not None:
    import triton.language as tl

# the norms with HF's `weight * normalise(x).to(dtype)` formula (not Gemma's `1 + weight`)
FUSABLE = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


def fusable_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in FUSABLE]


@contextlib.contextmanager
def fused_norms(modules: list[torch.nn.Module]) -> Iterator[None]:
    for module in modules:
        module.forward = _FusedForward(module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


class _FusedForward:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm_triton(hidden, self.module.weight, self.module.variance_epsilon)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of x [..., X] with weight [X] (X: E, or D for a per-head norm), one kernel."""
    if triton is None:
        raise RuntimeError("the fused RMSNorm needs Triton")
    n = x.shape[-1]
    x_N_X = x.reshape(-1, n)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out_N_X = torch.empty(x_N_X.shape, dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x_N_X.shape[0],)](
        x_N_X,
        weight,
        out_N_X,
        x_N_X.stride(0),
        out_N_X.stride(0),
        n,
        eps,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out_N_X.view(x.shape)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, W, Out, stride_x, stride_out, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        valid = offs < N
        x = tl.load(X + row * stride_x + offs, mask=valid, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, axis=0) / N
        normed = (x * tl.rsqrt(variance + eps)).to(X.dtype.element_ty)
        w = tl.load(W + offs, mask=valid, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(Out + row * stride_out + offs, out.to(Out.dtype.element_ty), mask=valid)
