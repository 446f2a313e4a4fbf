"""Paged attention pieces on the CPU: the sampler's draw, the decode reference, the runner."""

from __future__ import annotations

import torch

from verst.engine.paged_attention import decode_mask, paged_decode_reference, step_mask
from verst.engine.sampling import _draw


def test_draw_follows_the_weights_and_never_picks_a_zero() -> None:
    weights_V = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    gen = torch.Generator().manual_seed(0)
    picks = _draw(weights_V.repeat(40_000, 1), gen)
    counts = torch.bincount(picks, minlength=6).float() / picks.numel()
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts, weights_V, atol=0.01, rtol=0)


def test_decode_reference_equals_attention_over_the_unpaged_sequence() -> None:
    torch.manual_seed(0)
    page, hkv, hq, d = 4, 2, 6, 8
    k_pages = torch.randn(10, page, hkv, d)
    v_pages = torch.randn(10, page, hkv, d)
    table = torch.tensor([[7, 2, 5], [1, 0, 0]])
    seq = torch.tensor([10, 3])
    q = torch.randn(2, hq, d)
    out = paged_decode_reference(q, k_pages, v_pages, table, seq, d**-0.5)
    for b in range(2):
        k = k_pages[table[b]].reshape(-1, hkv, d)[: seq[b]].repeat_interleave(hq // hkv, 1)
        v = v_pages[table[b]].reshape(-1, hkv, d)[: seq[b]].repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("hd,shd->hs", q[b], k) * d**-0.5
        expected = torch.einsum("hs,shd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[b], expected)


def test_masks_see_exactly_the_past_and_the_causal_present() -> None:
    mask = step_mask(torch.tensor([3, 0]), T=2, width=2, group=2, page_size=4)
    assert mask.shape == (2, 1, 4, 8)
    assert mask[0, 0, 0].tolist() == [True] * 4 + [False] * 4  # position 3 sees 0..3
    assert mask[0, 0, 1].tolist() == [True] * 5 + [False] * 3
    assert mask[1, 0, 3].tolist() == [True, True] + [False] * 6
    assert decode_mask(torch.tensor([5]), 2, 3, 4)[0, 0, 2].tolist() == [True] * 5 + [False] * 3


def test_a_window_hides_the_keys_it_slid_past() -> None:
    # HF's sliding window: a query at position p sees keys at p - window < s <= p
    mask = step_mask(torch.tensor([5]), T=2, width=2, group=1, page_size=4, window=3)
    assert mask[0, 0, 0].tolist() == [False] * 3 + [True] * 3 + [False] * 2  # p = 5: 3..5
    assert mask[0, 0, 1].tolist() == [False] * 4 + [True] * 3 + [False]  # p = 6: 4..6
