"""The CUDA engine's fused Triton kernels for the lean forward: one launch where PyTorch runs
several.

A decode step on CUDA replays a graph of a few hundred small kernels; at these sizes each costs
its minimum of a few microseconds however little it computes, so the count sets the step time.
`CudaKernels` offers what `lean_decoder` asks of a kernel set, on CUDA:

- `rms_norm`: HF's RMSNorm, one kernel (`fused_norm.rms_norm_triton`);
- `add_rms_norm`: the residual add and the next RMSNorm, one kernel instead of two;
- `norm_rope`: the per-head norm (Qwen3) and rotary of queries or keys, one kernel instead of
  eight to ten;
- `rope_store`: in a decode step, `norm_rope` of queries and keys and the writes of the new
  keys and values into the KV pool, one kernel instead of four;
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

    def rope_store(
        self,
        q_N_X: torch.Tensor,
        k_N_X: torch.Tensor,
        v_N_X: torch.Tensor,
        norms: tuple[torch.Tensor, float, torch.Tensor, float] | None,
        cos_N_D: torch.Tensor,
        sin_N_D: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """`norm_rope` of the queries and the keys, the keys and values written into their pool
        slots, in one kernel: the queries [N, Hq, D] back. `norms`: (q weight, q eps, k weight,
        k eps) of Qwen3's per-head norms, or None; `kv`: the pool's K and V of the layer as
        [slots, Hkv, D] and each row's slot [N]. Rows of q, k, v may be strided, their heads
        dense (the split of one fused Q/K/V output)."""
        k_flat, v_flat, slots_N = kv
        N, (_, Hkv, D) = q_N_X.shape[0], k_flat.shape
        Hq = q_N_X.shape[1] // D
        for x in (q_N_X, k_N_X, v_N_X):
            if x.stride(1) != 1:
                raise ValueError("rope_store needs each row's heads dense")
        q_weight, q_eps, k_weight, k_eps = norms if norms is not None else (q_N_X, 0.0, q_N_X, 0.0)
        q_out = torch.empty((N, Hq, D), dtype=q_N_X.dtype, device=q_N_X.device)
        _rope_store_kernel[(N, Hq + 2 * Hkv)](
            q_N_X, k_N_X, v_N_X, q_weight, k_weight, cos_N_D.contiguous(), sin_N_D.contiguous(),
            q_out, k_flat, v_flat, slots_N, q_N_X.stride(0), k_N_X.stride(0), v_N_X.stride(0),
            q_eps, k_eps, HQ=Hq, HKV=Hkv, D=D, HALF=D // 2, HAS_NORM=norms is not None,
            num_warps=1,
        )  # fmt: skip
        return q_out

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
    def _normed_rotated(
        X, W, Cos, Sin, eps, D: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, dtype
    ):
        """One head of D values at X: its RMSNorm (with HAS_NORM), then HF's rotary."""
        offs = tl.arange(0, D)
        # rotate_half pairs element i with i + D/2 (first half, negated) or i - D/2
        partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
        x = tl.load(X + offs).to(tl.float32)
        xp = tl.load(X + partner).to(tl.float32)
        if HAS_NORM:
            inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            w = tl.load(W + offs).to(tl.float32)
            wp = tl.load(W + partner).to(tl.float32)
            x = (w * (x * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            xp = (wp * (xp * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        cos = tl.load(Cos + offs).to(tl.float32)
        sin = tl.load(Sin + offs).to(tl.float32)
        rotated = tl.where(offs < HALF, -xp, xp)
        a = (x * cos).to(dtype).to(tl.float32)
        b = (rotated * sin).to(dtype).to(tl.float32)
        return (a + b).to(dtype)

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
        out = _normed_rotated(
            X + row * stride_x + head * D, W, Cos + row * D, Sin + row * D, eps, D, HALF,
            HAS_NORM, dtype,
        )  # fmt: skip
        tl.store(Out + (row * heads + head) * D + tl.arange(0, D), out)

    @triton.jit
    def _rope_store_kernel(
        Q, K, V, WQ, WK, Cos, Sin, QOut, KPool, VPool, Slots, stride_q, stride_k, stride_v,
        eps_q, eps_k, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
        HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    ):  # fmt: skip
        """Program (row, head): a query head normed and rotated into QOut, a key head normed
        and rotated into its pool slot, or a value head copied into its pool slot."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        dtype = QOut.dtype.element_ty
        cos, sin = Cos + row * D, Sin + row * D
        if head < HQ:
            out = _normed_rotated(
                Q + row * stride_q + head * D, WQ, cos, sin, eps_q, D, HALF, HAS_NORM, dtype
            )
            tl.store(QOut + (row * HQ + head) * D + tl.arange(0, D), out)
        else:
            slot = tl.load(Slots + row)
            kv = head - HQ
            if kv < HKV:
                out = _normed_rotated(
                    K + row * stride_k + kv * D, WK, cos, sin, eps_k, D, HALF, HAS_NORM, dtype
                )
                tl.store(KPool + (slot * HKV + kv) * D + tl.arange(0, D), out)
            else:
                kv -= HKV
                value = tl.load(V + row * stride_v + kv * D + tl.arange(0, D))
                tl.store(VPool + (slot * HKV + kv) * D + tl.arange(0, D), value)

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
