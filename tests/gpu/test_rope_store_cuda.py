"""`CudaKernels.rope_store`: the decode step's norm + rotary of queries and keys with the K/V
pool writes, in one kernel, bit for bit what `norm_rope` and two `index_copy_` give."""

from __future__ import annotations

import os

import pytest
import torch

from verst.engine.paged_attention import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs CUDA and Triton (or TRITON_INTERPRET=1)",
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_norms", [True, False])
def test_rope_store_equals_norm_rope_and_index_copy(dtype, with_norms) -> None:
    from verst.engine.kernels.cuda import CudaKernels

    torch.manual_seed(0)
    N, Hq, Hkv, D, slots = 5, 4, 2, 32, 40
    qkv = torch.randn(N, (Hq + 2 * Hkv) * D, device=DEVICE, dtype=dtype) * 2
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)  # strided rows, as the fused GEMM
    cos, sin = torch.randn(N, D, device=DEVICE), torch.randn(N, D, device=DEVICE)
    cos, sin = cos.to(dtype), sin.to(dtype)
    norms = None
    if with_norms:
        wq, wk = (
            torch.randn(D, device=DEVICE, dtype=dtype),
            torch.randn(D, device=DEVICE, dtype=dtype),
        )
        norms = (wq, 1e-6, wk, 1e-5)
    slots_N = torch.tensor([3, 17, 0, 39, 8], device=DEVICE)
    kernels = CudaKernels()
    pools = [torch.zeros(slots, Hkv, D, device=DEVICE, dtype=dtype) for _ in range(4)]
    q_out = kernels.rope_store(q, k, v, norms, cos, sin, (pools[0], pools[1], slots_N))

    def heads(x, h):
        return x.reshape(N, h, D)

    q_want = kernels.norm_rope(
        heads(q, Hq), norms and norms[0], norms[1] if norms else 0.0, cos, sin
    )
    k_want = kernels.norm_rope(
        heads(k, Hkv), norms and norms[2], norms[3] if norms else 0.0, cos, sin
    )
    pools[2].index_copy_(0, slots_N, k_want)
    pools[3].index_copy_(0, slots_N, heads(v, Hkv))
    assert torch.equal(q_out, q_want)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
