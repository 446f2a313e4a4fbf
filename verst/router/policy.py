"""Key-affinity routing state, pure and in-process: which engine serves a request.

A `Router` pins each routing key (a session id, a sample's uuid) to one engine target the first
time it is seen, on the target with the fewest active requests, and keeps it there until
`release(key)`; a key whose target is gone or unhealthy is pinned anew, lazily, on its next
request. Key-less requests go to the least-loaded target, unless sessions are on: then they are
refused with `MissingRoutingKey`, never silently load-balanced, because a session that drifts
between engines loses its KV prefix on every turn.

A target is an engine base URL, optionally with a data-parallel rank suffix `@rank`
(`http://127.0.0.1:30000@1`); keys pin to the target, health is tracked per base URL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"

_RANK = re.compile(r"^(?P<base>.+)@(?P<rank>\d+)$")


class MissingRoutingKey(ValueError):
    """Sessions are on and a request came without a routing key."""

    def __init__(self) -> None:
        super().__init__(
            f"this router runs with sessions on and the request has no {ROUTING_KEY_HEADER} "
            "header; session affinity needs it: every request of one session must carry the same "
            "key so that it reaches the engine holding the session's KV prefix (no load-based "
            "fallback is made)"
        )


class NoEngineAvailable(RuntimeError):
    """No registered engine is healthy."""


def split_rank(target: str) -> tuple[str, int | None]:
    """`http://h:p@1` → (`http://h:p`, 1); a target without a rank → (target, None)."""
    match = _RANK.match(target.rstrip("/"))
    if match is None:
        return target.rstrip("/"), None
    return match["base"].rstrip("/"), int(match["rank"])


def validate_engine_url(url: str) -> str:
    """`url` normalised if it is `http(s)://host[:port][@rank]` and nothing else; ValueError
    (with the reason) otherwise."""
    if not url.isprintable() or any(c.isspace() for c in url):
        raise ValueError(f"engine URL {url!r} holds spaces or control characters")
    base, _ = split_rank(url)
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"engine URL {url!r}: the scheme must be http or https")
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as error:
        raise ValueError(f"engine URL {url!r}: the port must be a number in 0-65535") from error
    host = parts.hostname
    if not host or len(host) > 253 or any(len(label) > 63 for label in host.split(".")):
        raise ValueError(f"engine URL {url!r} has no valid host")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"engine URL {url!r}: give only scheme://host:port")
    if parts.path not in ("", "/"):
        raise ValueError(f"engine URL {url!r}: give only scheme://host:port, without a path")
    return normalize(url)


def normalize(target: str) -> str:
    base, rank = split_rank(target)
    return base if rank is None else f"{base}@{rank}"


@dataclass
class EngineState:
    requests: int = 0  # requests begun on this target, ever
    active: int = 0  # requests begun and not yet ended
    healthy: bool = True


class Router:
    """Routing state over engine targets; not thread-safe (use it from one event loop)."""

    def __init__(self, engines: list[str], *, sessions: bool = False) -> None:
        self.sessions = sessions
        self._engines: dict[str, EngineState] = {}  # insertion order = tie order
        self._keys: dict[str, str] = {}  # routing key → target
        self._pinned: dict[str, int] = {}  # target → number of keys pinned to it
        self.refusals = 0  # key-less requests refused (sessions on)
        self.no_engine = 0  # requests refused because no engine was healthy
        self.re_placements = 0  # keys moved because their engine went away
        for url in engines:
            self.add_engine(url)

    # ---- engines -------------------------------------------------------------------------

    @property
    def engines(self) -> list[str]:
        """All registered targets, healthy or not, in registration order."""
        return list(self._engines)

    @property
    def live_engines(self) -> list[str]:
        return [t for t, s in self._engines.items() if s.healthy]

    def base_urls(self) -> list[str]:
        """The distinct engine servers (targets without their rank), in registration order."""
        return list(dict.fromkeys(split_rank(t)[0] for t in self._engines))

    def add_engine(self, url: str) -> bool:
        """Register `url` (or mark it healthy again); False when it was already registered."""
        target = normalize(url)
        if target in self._engines:
            self._engines[target].healthy = True
            return False
        self._engines[target] = EngineState()
        return True

    def remove_engine(self, url: str) -> list[str]:
        """Forget a target, or every rank of a base URL; its keys move on their next request."""
        removed = self._matching(url)
        for target in removed:
            del self._engines[target]
        return removed

    def set_healthy(self, url: str, healthy: bool) -> list[str]:
        """Take a target (or all ranks of a base URL) out of routing, or put it back.

        Keys pinned to an unhealthy target are re-placed on their next request; keys not yet
        re-placed return to it if it comes back (its KV cache may still hold their prefix).
        """
        matched = self._matching(url)
        for target in matched:
            self._engines[target].healthy = healthy
        return matched

    def is_healthy(self, url: str) -> bool:
        return any(self._engines[t].healthy for t in self._matching(url))

    def _matching(self, url: str) -> list[str]:
        target = normalize(url)
        if target in self._engines:
            return [target]
        return [t for t in self._engines if split_rank(t)[0] == target]

    # ---- routing -------------------------------------------------------------------------

    def least_loaded(self) -> str:
        """The live target with the fewest active requests.

        Ties go to the target with fewer pinned keys, then fewer requests so far, then the first
        registered: with idle engines, sequential sessions still spread out.
        """
        live = self.live_engines
        if not live:
            self.no_engine += 1
            raise NoEngineAvailable(
                f"no healthy engine among {len(self._engines)} registered: "
                f"{', '.join(self._engines) or 'none'}"
            )

        def load(target: str) -> tuple[int, int, int]:
            state = self._engines[target]
            return state.active, self._pinned.get(target, 0), state.requests

        return min(live, key=load)  # min keeps the first of equals: registration order

    def pick(self, key: str | None) -> str:
        """The target for a request with routing key `key` (None or "" = no key)."""
        if not key:
            if self.sessions:
                self.refusals += 1
                raise MissingRoutingKey()
            return self.least_loaded()
        target = self._keys.get(key)
        if target is not None:
            state = self._engines.get(target)
            if state is not None and state.healthy:
                return target
        new_target = self.least_loaded()
        if target is not None:
            self.re_placements += 1
            self._unpin(target)
        self._keys[key] = new_target
        self._pinned[new_target] = self._pinned.get(new_target, 0) + 1
        return new_target

    def _unpin(self, target: str) -> None:
        self._pinned[target] -= 1
        if not self._pinned[target]:
            del self._pinned[target]

    def begin(self, target: str) -> None:
        state = self._engines.get(target)
        if state is not None:
            state.requests += 1
            state.active += 1

    def end(self, target: str) -> None:
        # The target may have been removed while the request ran: nothing to count then.
        state = self._engines.get(target)
        if state is not None and state.active > 0:
            state.active -= 1

    def release(self, key: str) -> bool:
        """Forget a key at the end of its session; False when it was not pinned."""
        target = self._keys.pop(key, None)
        if target is None:
            return False
        self._unpin(target)
        return True

    def key_target(self, key: str) -> str | None:
        return self._keys.get(key)

    # ---- metrics -------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        engines = {
            target: {
                "requests": state.requests,
                "active": state.active,
                "keys": self._pinned.get(target, 0),
                "healthy": state.healthy,
            }
            for target, state in self._engines.items()
        }
        return {
            "sessions": self.sessions,
            "engines": engines,
            "requests": sum(s.requests for s in self._engines.values()),
            "active": sum(s.active for s in self._engines.values()),
            "active_keys": len(self._keys),
            "refusals": self.refusals,
            "no_engine": self.no_engine,
            "re_placements": self.re_placements,
        }
