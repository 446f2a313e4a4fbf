"""The CUDA engine's fused Triton kernels for the lean forward: one launch where PyTorch runs
several.

A decode step on CUDA replays a graph of a few hundred small kernels; at these sizes each costs
its minimum of a few microseconds however little it computes, so the count sets the step time.
`CudaKernels` offers what `lean_decoder` asks of a kernel set, on CUDA:

- `rms_norm`: HF's RMSNorm, one kernel (`fused_norm.rms_norm_triton`);
- `add_rms_norm`: the residual add and the next RMSNorm, one kernel instead of two;
- `norm_rope`: the per-head norm (Qwen3) and rotary of queries or keys, one kernel instead of
  eight to ten;
- `silu_mul`: the MLP's activation and product, one kernel instead of two.

Each rounds to the tensor dtype wherever HF's code does (float32 statistics, normalise, cast,
times the weight, cast; each rotary product and their sum cast), so bf16 results match
PyTorch's to the last bit or one unit of it (exp, rsqrt).
"""

from __future__ import annotations

import torch

from verst.engine.kernels.cpu import dense_rows
from verst.engine.kernels.fused_norm import rms_norm_triton
from verst.engine.kv_pool import attention_shape
from verst.engine.paged_attention import triton

if triton is not None:
    import triton.language as tl


class CudaKernels:
    @staticmethod
    def fits(config, dtype: torch.dtype) -> bool:
        """Whether a model of this config is within the kernels' reach (a power-of-two head
        dim; one that is not runs PyTorch's ops)."""
        _, _, head_dim = attention_shape(config)
        return triton is not None and head_dim & (head_dim - 1) == 0 and dtype.is_floating_point

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_triton(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's residual add then RMSNorm over [..., n]: (x + residual, its norm), one kernel."""
        n = x.shape[-1]
        x_N_E, residual_N_E = dense_rows(x, n), dense_rows(residual, n)
        sum_N_E = torch.empty((x_N_E.shape[0], n), dtype=x.dtype, device=x.device)
        out_N_E = torch.empty_like(sum_N_E)
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(x_N_E.shape[0],)](
            x_N_E, residual_N_E, weight, sum_N_E, out_N_E, x_N_E.stride(0),
            residual_N_E.stride(0), n, eps, BLOCK=block, num_warps=min(max(block // 256, 1), 8),
        )  # fmt: skip
        return sum_N_E.view(x.shape), out_N_E.view(x.shape)

    def norm_rope(
        self,
        x_N_H_D: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        cos_N_D: torch.Tensor,
        sin_N_D: torch.Tensor,
    ) -> torch.Tensor:
        """Per-head RMSNorm (when `weight` is given), then HF's rotary: [N, H, D] contiguous.
        x's heads must be dense within a row; rows may be strided."""
        N, H, D = x_N_H_D.shape
        if x_N_H_D.stride(2) != 1 or x_N_H_D.stride(1) != D:
            raise ValueError("norm_rope needs each row's heads dense")
        cos_N_D, sin_N_D = cos_N_D.contiguous(), sin_N_D.contiguous()
        out = torch.empty((N, H, D), dtype=x_N_H_D.dtype, device=x_N_H_D.device)
        _norm_rope_kernel[(N, H)](
            x_N_H_D,
            weight if weight is not None else x_N_H_D,  # unread without HAS_NORM
            cos_N_D,
            sin_N_D,
            out,
            x_N_H_D.stride(0),
            eps,
            D=D,
            HALF=D // 2,
            HAS_NORM=weight is not None,
            num_warps=1,
        )
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up over [..., I], the activation cast before the product."""
        n = gate.shape[-1]
        gate_N_I, up_N_I = dense_rows(gate, n), dense_rows(up, n)
        out = torch.empty((gate_N_I.shape[0], n), dtype=gate.dtype, device=gate.device)
        block = min(triton.next_power_of_2(n), 1024)
        _silu_mul_kernel[(gate_N_I.shape[0], triton.cdiv(n, block))](
            gate_N_I, up_N_I, out, gate_N_I.stride(0), up_N_I.stride(0), n, BLOCK=block
        )
        return out.view(*gate.shape[:-1], n)


if triton is not None:

    @triton.jit
    def _norm_rope_kernel(
        X,
        W,
        Cos,
        Sin,
        Out,
        stride_x,
        eps,
        D: tl.constexpr,
        HALF: tl.constexpr,
        HAS_NORM: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        heads = tl.num_programs(1)
        dtype = Out.dtype.element_ty
        offs = tl.arange(0, D)
        # rotate_half pairs element i with i + D/2 (first half, negated) or i - D/2
        partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
        base = X + row * stride_x + head * D
        x = tl.load(base + offs).to(tl.float32)
        xp = tl.load(base + partner).to(tl.float32)
        if HAS_NORM:
            inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            w = tl.load(W + offs).to(tl.float32)
            wp = tl.load(W + partner).to(tl.float32)
            x = (w * (x * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            xp = (wp * (xp * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        cos = tl.load(Cos + row * D + offs).to(tl.float32)
        sin = tl.load(Sin + row * D + offs).to(tl.float32)
        rotated = tl.where(offs < HALF, -xp, xp)
        a = (x * cos).to(dtype).to(tl.float32)
        b = (rotated * sin).to(dtype).to(tl.float32)
        tl.store(Out + (row * heads + head) * D + offs, (a + b).to(dtype))

    @triton.jit
    def _add_rms_norm_kernel(X, R, W, Sum, Out, stride_x, stride_r, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        valid = offs < N
        dtype = Sum.dtype.element_ty
        x = tl.load(X + row * stride_x + offs, mask=valid, other=0.0).to(tl.float32)
        r = tl.load(R + row * stride_r + offs, mask=valid, other=0.0).to(tl.float32)
        total = (x + r).to(dtype)
        tl.store(Sum + row * N + offs, total, mask=valid)
        total = total.to(tl.float32)
        inv = tl.rsqrt(tl.sum(total * total, axis=0) / N + eps)
        normed = (total * inv).to(dtype).to(tl.float32)
        w = tl.load(W + offs, mask=valid, other=0.0).to(tl.float32)
        tl.store(Out + row * N + offs, (w * normed).to(dtype), mask=valid)

    @triton.jit
    def _silu_mul_kernel(G, U, Out, stride_g, stride_u, N, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < N
        dtype = Out.dtype.element_ty
        g = tl.load(G + row * stride_g + offs, mask=valid, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + offs, mask=valid, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(Out + row * N + offs, (act * u).to(dtype), mask=valid)
