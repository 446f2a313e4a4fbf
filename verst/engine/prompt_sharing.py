"""Prompt sharing: the samples of a group (requests with the same prompt arriving together)
compute that prompt once. While one request prefills it, the others with the same tokens and
adapter wait as its followers; when the prefill ends each follower starts on a copy of its KV
(whole pages shared through the prefix cache, the last partial page copied) and samples from
the leader's last logits. A freshly prefilled prompt also enters the prefix cache at once, not
when its request ends.

`PromptSharing` is a part of `Scheduler`: it reads the scheduler's `pool`, `cache`, `running`,
`waiting` and `max_running`.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from verst.engine.running import Running

if TYPE_CHECKING:
    from verst.engine.kv_pool import KVPool
    from verst.engine.radix_cache import RadixCache


class PromptSharing:
    pool: KVPool
    cache: RadixCache | None
    running: list[Running]
    waiting: deque[Running]
    max_running: int

    @staticmethod
    def _may_lead(r: Running) -> bool:
        fresh = len(r.tokens) == r.prompt_length  # a retracted request may carry its output
        return fresh and r.computed < r.prompt_length and r.request.logprob_start_len < 0

    @staticmethod
    def _may_follow(r: Running) -> bool:
        return len(r.tokens) == r.prompt_length and r.request.logprob_start_len < 0

    def _fork_followers(self, prefilled: list[Running]) -> dict[int, list[Running]]:
        """Start every waiting follower of a request whose prefill just ended, on a copy of its
        prompt's KV (whole pages shared through the prefix cache, the last partial page
        copied). Returns the started followers by id(leader); a follower that finds no room
        stays queued and computes its prompt as any request would."""
        leaders = {id(r): r for r in prefilled if r in self.running}
        forks: dict[int, list[Running]] = {}
        source: list[int] = []
        target: list[int] = []
        for f in self.waiting:
            leader = f.leader
            if leader is None or id(leader) not in leaders:
                continue
            if len(self.running) >= self.max_running or not self._share_kv(
                f, leader, source, target
            ):
                f.leader = None
                continue
            self.running.append(f)
            forks.setdefault(id(leader), []).append(f)
        if forks:
            started = {id(f) for fs in forks.values() for f in fs}
            self.waiting = deque(f for f in self.waiting if id(f) not in started)
            self.pool.copy_pages(source, target)
        return forks

    def _share_kv(self, f: Running, leader: Running, source: list[int], target: list[int]) -> bool:
        """Give f the leader's prompt KV: cached whole pages locked, the rest to copy."""
        shared: list[int] = []
        if self.cache is not None and leader.match is not None:
            match = self.cache.match_prefix(list(self._prompt_key(leader)), record_stats=False)
            shared = list(match.pages)
        own = leader.pages[len(shared) : -(-leader.computed // self.pool.page_size)]
        if len(own) > self.pool.num_free():
            return False
        if shared:
            self.cache.lock(match)
            f.match = match
        f.pages = shared + self.pool.alloc(len(own))
        source += own
        target += f.pages[len(shared) :]
        f.computed = f.cached_tokens = leader.computed
        f.leader = None
        return True

    def _prompt_key(self, r: Running) -> tuple[int, ...]:
        """The whole pages of r's prompt that a cache hit can cover (all but its last token),
        as the prefix cache keys them."""
        ps = self.pool.page_size
        return tuple(self._keyed(r, r.tokens[: (r.prompt_length - 1) // ps * ps]))

    @staticmethod
    def _keyed(r: Running, tokens: list[int]) -> list[int]:
        """Token ids as prefix-cache keys: a request with an adapter has keys of its own (the
        same tokens under another adapter, or none, have other KV)."""
        if not r.cache_offset:
            return tokens
        return [t + r.cache_offset for t in tokens]

    @staticmethod
    def _lead_key(r: Running) -> tuple[int | None, tuple[int, ...]]:
        return r.adapter, tuple(r.tokens)

    def _share_prompt(self, r: Running) -> None:
        """Put r's freshly prefilled prompt pages in the prefix cache now, not when r ends, so
        requests with the same prompt skip its prefill; r keeps them locked while it runs."""
        key = self._prompt_key(r)
        if self.cache is None or not key or (r.match is not None and r.match.length >= len(key)):
            return
        pages = len(key) // self.pool.page_size
        duplicates = self.cache.insert(list(key), r.pages[:pages])
        match = self.cache.match_prefix(list(key), record_stats=False)
        self.cache.lock(match)
        if r.match is not None:
            self.cache.unlock(r.match)
        r.match = match
        r.pages[:pages] = match.pages  # the tree's copy where another request cached it first
        self.pool.free(duplicates)
