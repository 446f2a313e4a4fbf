"""The CUDA decode attention kernel, one program per row and KV head or split over each
sequence (flash decoding), against the plain PyTorch reference."""

from __future__ import annotations

import os

import pytest
import torch

from verst.engine.kernels.paged_decode import decode_splits, paged_decode_triton
from verst.engine.paged_attention import paged_decode_reference, triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs CUDA and Triton (or TRITON_INTERPRET=1)",
)


@pytest.mark.parametrize("splits", [1, 2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_matches_reference(splits, dtype) -> None:
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly (the unsplit kernel too)")
    torch.manual_seed(0)
    hq, hkv, d, page, pages = 4, 2, 16, 4, 40
    k = torch.randn(pages, page, hkv, d, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    table = torch.randperm(pages, device=DEVICE)[:36].view(3, 12)  # 48 positions a row
    seq = torch.tensor([1, 17, 48], device=DEVICE)  # one key; a partial page; all of them
    q = torch.randn(3, hq, d, device=DEVICE, dtype=dtype)
    got = paged_decode_triton(q, k, v, table, seq, d**-0.5, splits=splits)
    want = paged_decode_reference(q, k, v, table, seq, d**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=0)


def test_splits_fill_the_gpu_only_where_rows_are_few() -> None:
    assert decode_splits(rows=1, kv_heads=2, table_pages=256, page=16) == 16
    assert decode_splits(rows=16, kv_heads=2, table_pages=256, page=16) == 4
    assert decode_splits(rows=64, kv_heads=2, table_pages=256, page=16) == 1
    assert decode_splits(rows=1, kv_heads=2, table_pages=3, page=16) == 1  # one block of keys
    with pytest.raises(ValueError, match="power of two"):
        q = torch.zeros(1, 2, 16, device=DEVICE)
        k = torch.zeros(2, 4, 2, 16, device=DEVICE)
        table = torch.zeros(1, 2, dtype=torch.long, device=DEVICE)
        paged_decode_triton(q, k, k, table, torch.ones(1, device=DEVICE), 1.0, splits=3)
