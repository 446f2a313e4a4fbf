"""The radix prefix cache: token-id prefixes shared across requests, mapped to the KV pages
that hold them.

Owns `RadixCache`, a radix tree at page granularity: every node's key is a whole number of
pages of token ids and its value is those pages, so only full pages are cached and shared.
Promises:
- `match_prefix` finds the longest cached prefix in whole pages and counts hits for the hit rate;
- a page is owned either by the tree or by its caller, never both: `insert` adopts the new pages
  and hands back duplicates of pages it already holds;
- locked paths are never evicted; `evict` frees unlocked leaves least recently used first,
  returning their pages to the `KVPool`.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from verst.engine.kv_pool import KVPool


@dataclass(eq=False, slots=True)
class _Node:
    key: tuple[int, ...]  # token ids, len(pages) * page_size of them
    pages: list[int]
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # by first page's ids
    lock_ref: int = 0  # running requests whose prefix passes through this node
    last_access: int = 0
    evicted: bool = False


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a query: `length` tokens held in `pages`; `node` is the
    handle `lock` / `unlock` take."""

    length: int
    pages: list[int]
    node: _Node


class RadixCache:
    """Prefix cache over a `KVPool`; frees the pages it evicts back to that pool."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._root = _Node(key=(), pages=[], parent=None)
        self._clock = itertools.count(1)  # a logical clock keeps LRU order exact and testable
        self._cached_pages = 0
        self._locked_pages = 0
        self._hit_tokens = 0
        self._query_tokens = 0

    def match_prefix(self, tokens: list[int], *, record_stats: bool = True) -> PrefixMatch:
        """Longest cached prefix of `tokens`, in whole pages; touches the matched path.

        A caller that needs logits for the last token should match `tokens[:-1]`, so at least
        one token is left to compute. `record_stats=False` keeps the lookup out of the hit rate
        (for re-matching a request's own freshly inserted tokens).
        """
        ps = self.page_size
        n = len(tokens) // ps
        key = tuple(tokens[: n * ps])
        now = next(self._clock)
        node, i, pages = self._root, 0, []
        while i < n:
            child = node.children.get(key[i * ps : (i + 1) * ps])
            if child is None:
                break
            m = self._common_pages(child, key, i)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = now
            pages.extend(child.pages)
            node, i = child, i + m
        if record_stats:
            self._query_tokens += len(tokens)
            self._hit_tokens += i * ps
        return PrefixMatch(length=i * ps, pages=pages, node=node)

    def lock(self, match: PrefixMatch) -> None:
        """Pin the matched path: eviction skips it until the matching `unlock`."""
        if match.node.evicted:
            raise ValueError("cannot lock a prefix that has been evicted; match again")
        node = match.node
        while node is not self._root:
            if node.lock_ref == 0:
                self._locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent
            assert node is not None

    def unlock(self, match: PrefixMatch) -> None:
        node = match.node
        while node is not self._root:
            if node.lock_ref == 0:
                raise ValueError("unlock of a prefix that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_pages -= len(node.pages)
            node = node.parent
            assert node is not None

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Cache the whole-page prefix of `tokens` whose KV is in `pages` (page j holds tokens
        [j * page_size, (j + 1) * page_size)); returns the caller's pages that duplicate pages
        the tree already holds for an equal prefix, for the caller to free.

        Only the first min(len(pages), len(tokens) // page_size) pages are considered; pages
        past them stay the caller's. Pages already in the tree at the same position (a locked
        match the caller is extending) are neither adopted nor returned. A running request that
        still reads a returned duplicate must switch to the tree's page (match again) before
        freeing it.
        """
        ps = self.page_size
        n = min(len(pages), len(tokens) // ps)
        key = tuple(tokens[: n * ps])
        now = next(self._clock)
        node, i, duplicates = self._root, 0, []
        while i < n:
            first = key[i * ps : (i + 1) * ps]
            child = node.children.get(first)
            if child is None:
                new = _Node(key=key[i * ps :], pages=list(pages[i:n]), parent=node)
                new.last_access = now
                node.children[first] = new
                self._cached_pages += n - i
                break
            m = self._common_pages(child, key, i)
            if m < len(child.pages):
                child = self._split(child, m)
            duplicates.extend(
                own for own, held in zip(pages[i : i + m], child.pages, strict=True) if own != held
            )
            child.last_access = now
            node, i = child, i + m
        return duplicates

    def evict(self, n_pages: int) -> int:
        """Free at least `n_pages` (if that many are evictable) from unlocked leaves, least
        recently used first; returns the number of pages freed."""
        heap = [
            (node.last_access, id(node), node)
            for node in self._nodes()
            if not node.children and node.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < n_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self._remove(leaf)
            freed += len(leaf.pages)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Flush the tree, freeing every page to the pool (e.g. after a weight update, when the
        cached KV is stale). Hit statistics are cumulative and survive."""
        if self._locked_pages:
            raise RuntimeError(
                f"cannot reset the prefix cache: {self._locked_pages} pages are locked by "
                "running requests"
            )
        self.pool.free([page for node in self._nodes() for page in node.pages])
        for node in self._nodes():
            node.evicted = True
        self._root.children.clear()
        self._cached_pages = 0

    def evictable_pages(self) -> int:
        # An unlocked node has only unlocked descendants, so every unlocked page is reachable
        # by repeated leaf eviction.
        return self._cached_pages - self._locked_pages

    def stats(self) -> dict[str, float]:
        return {
            "cached_pages": self._cached_pages,
            "locked_pages": self._locked_pages,
            "evictable_pages": self.evictable_pages(),
            "hit_tokens": self._hit_tokens,
            "query_tokens": self._query_tokens,
            "hit_rate": self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
        }

    def _common_pages(self, child: _Node, key: tuple[int, ...], i: int) -> int:
        """How many whole pages of `child.key` equal `key` from page i on (>= 1: the first
        page matched to find the child)."""
        ps = self.page_size
        m, limit = 1, min(len(child.pages), len(key) // ps - i)
        while m < limit:
            ours, theirs = (i + m) * ps, m * ps
            if key[ours : ours + ps] != child.key[theirs : theirs + ps]:
                break
            m += 1
        return m

    def _split(self, node: _Node, m: int) -> _Node:
        """Split `node` after its first m pages; returns the new upper node."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None
        # Every lock through `node` also passes through its new upper half.
        upper = _Node(
            key=node.key[: m * ps],
            pages=node.pages[:m],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.key, node.pages, node.parent = node.key[m * ps :], node.pages[m:], upper
        upper.children[node.key[:ps]] = node
        parent.children[upper.key[:ps]] = upper
        return upper

    def _remove(self, leaf: _Node) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.key[: self.page_size]]
        leaf.parent = None
        leaf.evicted = True
        self._cached_pages -= len(leaf.pages)
        self.pool.free(leaf.pages)

    def _nodes(self) -> list[_Node]:
        """Every node but the root."""
        out: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
