"""Batch-invariant GEMM on CUDA: one Triton kernel of fixed tiles, so each output element is
summed over its depth in the same order whatever the number of rows, a row's place among
them, or the batch count.

cuBLAS picks its kernel (tile shape, split-K) from the problem's shape, and the summation
order with it: an fp32 linear of 40 rows gives other bits than the same rows among 300
(measured on an H200). Here the tiles are fixed (BLOCK_M × BLOCK_N outputs, BLOCK_K of depth
per step, no split-K, no autotuning) and the row count is not specialised on, so every output
element accumulates the same BLOCK_K-wide partial products in the same order into an fp32
accumulator. Depth past the end is masked to zero: a sum over a longer, zero-padded depth
(attention's keys past a query) gives the same bits.

The backward runs PyTorch's matmuls: gradients need no invariance.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32

if triton is not None:

    @triton.jit(do_not_specialize=["M", "X"])
    def _matmul_kernel(
        a_ptr, b_ptr, c_ptr, X, M, N, K,
        s_ax, s_am, s_ak, s_bx, s_bk, s_bn, s_cx, s_cm, s_cn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        batch = tl.program_id(0)
        rows_M = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_N = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        depth_K = tl.arange(0, BLOCK_K)
        a = a_ptr + batch * s_ax + rows_M[:, None] * s_am + depth_K[None, :] * s_ak
        b = b_ptr + batch * s_bx + depth_K[:, None] * s_bk + cols_N[None, :] * s_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            in_depth_K = depth_K + k0 < K
            a_tile = tl.load(a, mask=(rows_M[:, None] < M) & in_depth_K[None, :], other=0.0)
            b_tile = tl.load(b, mask=in_depth_K[:, None] & (cols_N[None, :] < N), other=0.0)
            acc = tl.dot(a_tile, b_tile, acc, input_precision=PRECISION)
            a += BLOCK_K * s_ak
            b += BLOCK_K * s_bk
        c = c_ptr + batch * s_cx + rows_M[:, None] * s_cm + cols_N[None, :] * s_cn
        mask = (rows_M[:, None] < M) & (cols_N[None, :] < N)
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def _launch(a_X_M_K: torch.Tensor, b_X_K_N: torch.Tensor) -> torch.Tensor:
    """a @ b, [X, M, K] @ [X or 1, K, N] -> [X, M, N] in a's dtype (fp32 accumulation)."""
    X, M, K = a_X_M_K.shape
    N = b_X_K_N.shape[-1]
    out_X_M_N = a_X_M_K.new_empty(X, M, N)
    if out_X_M_N.numel() == 0:
        return out_X_M_N
    shared = b_X_K_N.shape[0] == 1
    grid = (X, triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul_kernel[grid](
        a_X_M_K, b_X_K_N, out_X_M_N, X, M, N, K,
        *a_X_M_K.stride(), 0 if shared else b_X_K_N.stride(0), *b_X_K_N.stride()[1:],
        *out_X_M_N.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if a_X_M_K.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out_X_M_N


class _InvariantMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_X_M_K: torch.Tensor, b_X_K_N: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a_X_M_K, b_X_K_N)
        return _launch(a_X_M_K, b_X_K_N)

    @staticmethod
    def backward(ctx, grad_X_M_N: torch.Tensor):
        a_X_M_K, b_X_K_N = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.matmul(grad_X_M_N, b_X_K_N.transpose(-1, -2))
        if ctx.needs_input_grad[1]:
            grad_b = torch.matmul(a_X_M_K.transpose(-1, -2), grad_X_M_N)
            if b_X_K_N.shape[0] == 1:
                grad_b = grad_b.sum(0, keepdim=True)
        return grad_a, grad_b


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul(a, b)` of CUDA tensors of one dtype, batch-invariant: a [..., M, K] and
    b [..., K, N] with the same leading dimensions, or b [K, N] shared by every batch."""
    if a.dtype != b.dtype:
        raise TypeError(f"invariant matmul of {a.dtype} and {b.dtype}")
    lead = a.shape[:-2]
    M, K = a.shape[-2:]
    N = b.shape[-1]
    a_X_M_K = a.reshape(-1, M, K)
    if b.dim() == 2:
        b_X_K_N = b.unsqueeze(0)
    elif b.shape[:-2] == lead:
        b_X_K_N = b.reshape(-1, K, N)
    else:
        raise ValueError(f"invariant matmul of {tuple(a.shape)} and {tuple(b.shape)}")
    return _InvariantMatmul.apply(a_X_M_K, b_X_K_N).view(*lead, M, N)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension, batch-invariant: each row's GEMM with a column of ones."""
    K = x.shape[-1]
    ones_K_1 = torch.ones(K, 1, dtype=x.dtype, device=x.device)
    return matmul(x.reshape(-1, K), ones_K_1).view(x.shape[:-1])
