"""The paged KV pool: budget sizing, allocator errors, write / gather round trips, slots."""

from __future__ import annotations

import pytest
import torch
import transformers

from verst.engine.kv_pool import KVPool, OutOfPages


def make_pool(num_pages: int = 8, page_size: int = 4, num_layers: int = 2) -> KVPool:
    return KVPool(
        num_layers=num_layers,
        num_kv_heads=2,
        head_dim=3,
        page_size=page_size,
        num_pages=num_pages,
        dtype=torch.float32,
        device="cpu",
    )


def test_from_budget_arithmetic() -> None:
    config = transformers.Qwen3Config(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    page_bytes = 2 * 3 * 8 * 2 * 16 * 2  # K+V x layers x page_size x kv heads x head_dim x bf16
    pool = KVPool.from_budget(
        config, budget_bytes=5 * page_bytes + 1, page_size=8, dtype=torch.bfloat16, device="cpu"
    )
    assert (pool.num_pages, pool.num_kv_heads, pool.head_dim) == (5, 2, 16)
    assert pool.k[2].shape == (5, 8, 2, 16) and pool.k[2].dtype == torch.bfloat16
    assert len(pool.k) == len(pool.v) == 3


def test_from_budget_fallbacks_and_too_small() -> None:
    # No num_key_value_heads / head_dim: all heads are KV heads, head_dim = hidden / heads.
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32)
    config.num_key_value_heads = None
    pool = KVPool.from_budget(
        config, budget_bytes=10**6, page_size=4, dtype=torch.float32, device="cpu"
    )
    assert (pool.num_kv_heads, pool.head_dim) == (4, 8)
    assert pool.num_pages == 10**6 // (2 * 2 * 4 * 4 * 8 * 4)
    with pytest.raises(ValueError, match="budget of 100 bytes"):
        KVPool.from_budget(config, budget_bytes=100, page_size=4, dtype=torch.float32, device="cpu")


def test_alloc_free_and_errors() -> None:
    pool = make_pool(num_pages=4)
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_free() == 1
    with pytest.raises(OutOfPages, match="need 2 KV pages, only 1"):
        pool.alloc(2)
    assert pool.num_free() == 1  # nothing partially allocated
    assert pool.alloc(0) == []
    pool.free([a[1]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[1]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[0], a[0]])
    with pytest.raises(ValueError, match="unknown KV page 9"):
        pool.free([a[2], 9])
    assert pool.num_free() == 2  # failed frees free nothing
    pool.free([a[0], a[2]])
    assert pool.num_free() == 4
    assert sorted(pool.alloc(4)) == [0, 1, 2, 3]


def test_slots_cross_page_boundaries() -> None:
    pool = make_pool(page_size=4)
    pages_N, offsets_N = pool.slots([7, 2, 5], 3, 10)
    assert pages_N.tolist() == [7, 2, 2, 2, 2, 5, 5]
    assert offsets_N.tolist() == [3, 0, 1, 2, 3, 0, 1]
    assert pool.slots([7], 2, 2)[0].numel() == 0
    with pytest.raises(ValueError, match="do not fit"):
        pool.slots([7, 2], 0, 9)


def test_write_gather_round_trip_with_padding_and_layers() -> None:
    pool = make_pool(num_pages=8, page_size=4, num_layers=2)
    lengths = [6, 3]
    page_lists = [pool.alloc(2), pool.alloc(1)]
    torch.manual_seed(0)
    kv = {}  # (layer, seq) -> (k_T_H_D, v_T_H_D)
    for layer in range(2):
        for seq, (pages, length) in enumerate(zip(page_lists, lengths, strict=True)):
            k_T_H_D, v_T_H_D = torch.randn(2, length, 2, 3).unbind(0)
            # Written in two chunks, as prefill then decode would.
            for start, end in [(0, length - 1), (length - 1, length)]:
                pages_N, offsets_N = pool.slots(pages, start, end)
                pool.write(layer, pages_N, offsets_N, k_T_H_D[start:end], v_T_H_D[start:end])
            kv[layer, seq] = (k_T_H_D, v_T_H_D)
    page_table_B_P = torch.tensor([page_lists[0], page_lists[1] + [-1]])
    lengths_B = torch.tensor(lengths)
    for layer in range(2):
        k_B_S_H_D, v_B_S_H_D = pool.gather(layer, page_table_B_P, lengths_B)
        assert k_B_S_H_D.shape == v_B_S_H_D.shape == (2, 8, 2, 3)
        for seq, length in enumerate(lengths):
            k_T_H_D, v_T_H_D = kv[layer, seq]
            assert torch.equal(k_B_S_H_D[seq, :length], k_T_H_D)
            assert torch.equal(v_B_S_H_D[seq, :length], v_T_H_D)
            assert not k_B_S_H_D[seq, length:].any() and not v_B_S_H_D[seq, length:].any()
    # Padding reads nothing even if a length overstates the pages.
    k_B_S_H_D, _ = pool.gather(0, page_table_B_P, torch.tensor([8, 8]))
    assert not k_B_S_H_D[1, 4:].any()
