"""The radix prefix cache: whole-page matching, node splits, duplicates, locking, LRU eviction
into the pool, reset and hit rate."""

from __future__ import annotations

import pytest
import torch

from verst.engine.kv_pool import KVPool
from verst.engine.radix_cache import RadixCache

PS = 4  # page size


def make_cache(num_pages: int = 32) -> tuple[KVPool, RadixCache]:
    pool = KVPool(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        page_size=PS,
        num_pages=num_pages,
        dtype=torch.float32,
        device="cpu",
    )
    return pool, RadixCache(pool)


def cache_seq(pool: KVPool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Allocate pages for `tokens`' whole pages and insert them; returns those pages."""
    pages = pool.alloc(len(tokens) // PS)
    assert cache.insert(tokens, pages) == []
    return pages


def test_match_on_empty_cache() -> None:
    _, cache = make_cache()
    match = cache.match_prefix(list(range(10)))
    assert (match.length, match.pages) == (0, [])
    cache.lock(match)  # locking the empty prefix is a no-op
    cache.unlock(match)
    assert cache.stats()["hit_rate"] == 0.0


def test_match_exact_longer_shorter_and_mid_page_divergence() -> None:
    pool, cache = make_cache()
    tokens = list(range(100, 112))  # 3 pages
    pages = cache_seq(pool, cache, tokens + [7, 7])  # the partial page is not cached
    assert len(pages) == 3
    assert cache.match_prefix(tokens).pages == pages  # exact
    longer = cache.match_prefix(tokens + [1, 2, 3, 4, 5])
    assert (longer.length, longer.pages) == (12, pages)
    shorter = cache.match_prefix(tokens[:9])  # 2 whole pages + 1 token
    assert (shorter.length, shorter.pages) == (8, pages[:2])
    diverging = tokens[:6] + [0] + tokens[7:]  # differs in the middle of page 1
    match = cache.match_prefix(diverging)
    assert (match.length, match.pages) == (4, pages[:1])
    assert cache.stats()["cached_pages"] == 3


def test_insert_splits_nodes() -> None:
    pool, cache = make_cache()
    a = list(range(16))  # 4 pages
    b = a[:8] + [50, 51, 52, 53]  # shares 2 pages, then diverges
    pages_a = cache_seq(pool, cache, a)
    pages_b = pool.alloc(3)
    # b's first two pages duplicate a's; the third is new and adopted.
    assert cache.insert(b, pages_b) == pages_b[:2]
    assert cache.match_prefix(a).pages == pages_a
    assert cache.match_prefix(b).pages == pages_a[:2] + [pages_b[2]]
    assert cache.stats()["cached_pages"] == 5
    # A query that ends inside a node splits it; later matches still see everything.
    assert cache.match_prefix(a[:12]).pages == pages_a[:3]
    assert cache.match_prefix(a).pages == pages_a


def test_duplicate_insert_returns_duplicates_not_own_pages() -> None:
    pool, cache = make_cache()
    tokens = list(range(12))
    pages = cache_seq(pool, cache, tokens)
    again = pool.alloc(3)
    assert cache.insert(tokens, again) == again
    # Extending a matched prefix with its own tree pages: those are not duplicates.
    match = cache.match_prefix(tokens)
    extra = pool.alloc(1)
    assert cache.insert(tokens + [9, 9, 9, 9], match.pages + extra) == []
    assert cache.match_prefix(tokens + [9, 9, 9, 9]).pages == pages + extra
    # Only len(pages) pages are considered, even with more whole pages of tokens.
    assert cache.insert(list(range(50, 62)), [pool.alloc(1)[0]]) == []
    assert cache.match_prefix(list(range(50, 62))).length == PS


def test_lock_prevents_eviction() -> None:
    pool, cache = make_cache()
    a, b = list(range(8)), list(range(20, 28))
    pages_a = cache_seq(pool, cache, a)
    cache_seq(pool, cache, b)
    match = cache.match_prefix(a)
    cache.lock(match)
    assert cache.evictable_pages() == 2
    assert cache.evict(10) == 2  # only b's pages go
    assert cache.match_prefix(a).pages == pages_a
    assert cache.match_prefix(b).length == 0
    # A lock through a node that is later split protects both halves.
    assert cache.insert(a + [5] * 4, pages_a + pool.alloc(1)) == []
    cache.match_prefix(a[:4])  # splits a's node
    assert cache.evict(10) == 1  # only the unlocked extension
    cache.unlock(match)
    assert cache.evict(10) == 2
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(match)
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(match)


def test_lru_order_and_frees_to_pool() -> None:
    pool, cache = make_cache(num_pages=16)
    seqs = [[s] * 8 for s in range(3)]  # three 2-page sequences
    for seq in seqs:
        cache_seq(pool, cache, seq)
    free_before = pool.num_free()
    cache.match_prefix(seqs[0])  # touch 0: now 1 is least recent
    assert cache.evict(1) == 2  # a whole leaf goes
    assert pool.num_free() == free_before + 2
    assert cache.match_prefix(seqs[1]).length == 0
    assert cache.match_prefix(seqs[0]).length == 8
    assert cache.evict(2) == 2
    assert cache.match_prefix(seqs[2]).length == 0
    assert cache.match_prefix(seqs[0]).length == 8


def test_evict_inner_nodes_after_their_children() -> None:
    pool, cache = make_cache(num_pages=16)
    trunk = list(range(8))
    cache_seq(pool, cache, trunk + [1] * 4)
    branch = pool.alloc(3)
    cache.insert(trunk + [2] * 4, branch)  # trunk pages are duplicates, freed by the caller
    pool.free(branch[:2])
    assert cache.stats()["cached_pages"] == 4
    assert cache.evict(100) == 4
    assert pool.num_free() == 16 and cache.stats()["cached_pages"] == 0


def test_reset() -> None:
    pool, cache = make_cache(num_pages=8)
    cache_seq(pool, cache, list(range(12)))
    match = cache.match_prefix(list(range(4)))
    cache.lock(match)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(match)
    cache.reset()
    assert pool.num_free() == 8
    assert cache.stats()["cached_pages"] == 0
    assert cache.match_prefix(list(range(12))).length == 0


def test_hit_rate() -> None:
    pool, cache = make_cache()
    cache_seq(pool, cache, list(range(8)))
    cache.match_prefix(list(range(10)))  # 8 of 10 hit
    cache.match_prefix([99] * 6)  # 0 of 6
    cache.match_prefix(list(range(8)), record_stats=False)  # not counted
    stats = cache.stats()
    assert (stats["hit_tokens"], stats["query_tokens"]) == (8, 16)
    assert stats["hit_rate"] == 0.5
