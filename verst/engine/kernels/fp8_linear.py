"""FP8 linear layers for the rollout engine (`engine.quantization: fp8`).

A projection weight [out, in] is held as float8_e4m3fn with one float32 scale per output
channel (the row's amax / 448, e4m3's largest value), made from the model's own weight and made
again whenever that weight changes (`DerivedWeights`). Activations are quantized the same way
per token at run time, and the GEMM runs as `torch._scaled_mm` (fp32 accumulation, the
activations' dtype out): y = (q_x · scale_x) (q_w · scale_w)ᵀ.

e4m3 keeps 3 mantissa bits: rounding to nearest moves a value of magnitude ≥ 2⁻⁶ · scale by at
most 2⁻⁴ of itself, and a smaller one (a subnormal) by at most 2⁻¹⁰ · scale (`max_error`).

CUDA's kernel reads the weight column-major (the transpose of the row-major copy, no copy made)
and needs both of its dimensions to be multiples of 16; `check_shape` enforces that on every
device, so a model that runs here runs on a GPU. Its row-wise scaling writes bf16 only (fp32
output needs cuBLAS 12.9 on sm90), so CUDA engines in fp8 run in bf16 (`check_device`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from verst.engine.paged_attention import triton

if triton is not None:
    import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MANTISSA_BITS = 3
SUBNORMAL_STEP = 2.0**-9  # e4m3's spacing below its smallest normal, 2^-6
ALIGN = 16  # both dimensions of `torch._scaled_mm`'s second operand, on CUDA
SCALE_FLOOR = 1e-12  # an all-zero row (a padding token) quantizes to zeros, not NaNs


class Fp8Weight(NamedTuple):
    weight_O_I: torch.Tensor  # float8_e4m3fn, row-major
    scale_1_O: torch.Tensor  # float32: weight ≈ weight_O_I * scale_1_O.T

    @classmethod
    def of(cls, weight_O_I: torch.Tensor) -> Fp8Weight:
        q_O_I, scale_O_1 = quantize_rows(weight_O_I.detach())
        return cls(q_O_I, scale_O_1.view(1, -1))

    def refill(self, weight_O_I: torch.Tensor) -> None:
        """Quantize `weight_O_I` into this copy's memory (CUDA graphs read it by address)."""
        q_O_I, scale_O_1 = quantize_rows(weight_O_I.detach())
        self.weight_O_I.copy_(q_O_I)
        self.scale_1_O.copy_(scale_O_1.view(1, -1))


def quantize_rows(x_N_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as e4m3 with one float32 scale a row (its amax / 448): x ≈ q_N_K * scale_N_1."""
    amax_N_1 = torch.linalg.vector_norm(
        x_N_K, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32
    )
    scale_N_1 = (amax_N_1 / FP8_MAX).clamp_(min=SCALE_FLOOR)
    return (x_N_K / scale_N_1).to(FP8), scale_N_1


def quantize_rows_triton(x_N_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` as one Triton kernel (CUDA): the activations of every projection of a
    decode step, where PyTorch's five ops a call each cost their launch."""
    x_N_K = x_N_K if x_N_K.stride(-1) == 1 else x_N_K.contiguous()
    N, K = x_N_K.shape
    q_N_K = torch.empty((N, K), dtype=FP8, device=x_N_K.device)
    scale_N_1 = torch.empty((N, 1), dtype=torch.float32, device=x_N_K.device)
    block = min(triton.next_power_of_2(K), 1024)
    _quantize_rows_kernel[(N,)](
        x_N_K, q_N_K, scale_N_1, x_N_K.stride(0), K, 1.0 / FP8_MAX, SCALE_FLOOR, BLOCK=block
    )
    return q_N_K, scale_N_1


def dequantize(q_N_K: torch.Tensor, scale_N_1: torch.Tensor) -> torch.Tensor:
    return q_N_K.float() * scale_N_1


def max_error(x_N_K: torch.Tensor) -> torch.Tensor:
    """The largest |x - dequantize(quantize_rows(x))| rounding to nearest allows, elementwise."""
    scale_N_1 = (x_N_K.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=SCALE_FLOOR)
    relative = x_N_K.float().abs() * 2.0 ** -(MANTISSA_BITS + 1)
    return torch.maximum(relative, scale_N_1 * SUBNORMAL_STEP / 2)


def fp8_linear(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, w, bias)` with x quantized per token and w the fp8 copy; x's dtype out."""
    x_N_K = x.reshape(-1, x.shape[-1])
    quantize = quantize_rows_triton if x.is_cuda and triton is not None else quantize_rows
    q_N_K, scale_N_1 = quantize(x_N_K)
    out_N_O = torch._scaled_mm(
        q_N_K,
        weight.weight_O_I.t(),
        scale_a=scale_N_1,
        scale_b=weight.scale_1_O,
        out_dtype=x.dtype,
    )
    if bias is not None:
        out_N_O = out_N_O + bias
    return out_N_O.view(*x.shape[:-1], -1)


def check_shape(name: str, out_features: int, in_features: int) -> None:
    """Refuse a projection `torch._scaled_mm` cannot take, naming it."""
    if out_features % ALIGN or in_features % ALIGN:
        raise ValueError(
            f"engine.quantization=fp8 needs every projection's input and output sizes to be "
            f"multiples of {ALIGN} (torch._scaled_mm's rule on CUDA); {name} is "
            f"[{out_features}, {in_features}]: use engine.quantization=none for this model"
        )


def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a device or dtype the fp8 GEMM does not run on."""
    if device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"engine.quantization=fp8 needs fp8 tensor cores (compute capability 8.9+: Ada, "
            f"Hopper, Blackwell); {name} has none"
        )
    if dtype != torch.bfloat16:
        raise ValueError(
            f"engine.quantization=fp8 on CUDA writes bf16 (torch._scaled_mm's row-wise "
            f"scaling); this engine runs {dtype}: set trainer.dtype=bfloat16 (verst serve "
            "--dtype bfloat16)"
        )


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(X, Q, Scale, stride_x, K, inv_fp8_max, floor, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = X + row * stride_x
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        # as PyTorch rounds: its division by a scalar multiplies by the scalar's fp32
        # reciprocal; its division by the scale tensor is IEEE's (Triton's `/` is approximate)
        scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, floor)
        tl.store(Scale + row, scale)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.div_rn(x, scale).to(Q.dtype.element_ty)
            tl.store(Q + row * K + offs, q, mask=offs < K)
