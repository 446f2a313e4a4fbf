"""Malformed and hostile HTTP requests for the servers' fuzz tests, drawn from a seeded
`random.Random`, and the check every answer must pass: a 4xx JSON error or a valid 2xx.

Imports aiohttp at module level: test files import this only after
`pytest.importorskip("aiohttp")`."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Values of every JSON type, and a few that break careless code.
ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    2**70,
    -(2**70),
    1e308,
    "",
    "x",
    "yes",
    "\u0000",
    "é" * 3,
    [],
    [1, 2],
    [True, False],
    ["a", 1],
    [[1], ["x"]],
    {},
    {"a": 1},
    {"text": 1},
    "<tool_call>{</tool_call>",
]


@dataclass(frozen=True)
class FuzzRequest:
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def odd_value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value: odd scalars, or small lists and objects of them."""
    roll = rng.random()
    if depth < 2 and roll < 0.15:
        return [odd_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2 and roll < 0.3:
        return {rng.choice(["role", "content", "text", "x"]): odd_value(rng, depth + 1)}
    return json.loads(json.dumps(rng.choice(ODD_VALUES)))  # a copy: bodies get mutated


def mutate(rng: random.Random, good: dict[str, Any]) -> dict[str, Any]:
    """`good` with one to three keys set to odd values (sometimes nested one level down)."""
    body = json.loads(json.dumps(good))
    for _ in range(rng.randint(1, 3)):
        target = body
        nested = [k for k, v in body.items() if isinstance(v, dict)]
        if nested and rng.random() < 0.3:
            target = body[rng.choice(nested)]
        keys = list(target) + ["n", "stream", "rid", "stop", "extra"]
        target[rng.choice(keys)] = odd_value(rng)
    return body


def raw_body(rng: random.Random, good: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """A body broken below the JSON level, and the headers that go with it."""
    json_type = {"Content-Type": "application/json"}
    kind = rng.randrange(9)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))), json_type
    if kind == 1:
        depth = rng.choice([100, 1000, 5000])
        return b"[" * depth + b"]" * depth, json_type
    if kind == 2:
        return b'{"a": "\\ud800", "messages": "\\udfff"}', json_type
    if kind == 3:
        return json.dumps(good).encode(), {**json_type, "Content-Encoding": "gzip"}
    if kind == 4:
        return gzip.compress(json.dumps(good).encode()), {**json_type, "Content-Encoding": "gzip"}
    if kind == 5:
        return json.dumps(good).encode()[: rng.randint(0, 20)], json_type
    if kind == 6:
        return b"NaN", json_type
    if kind == 7:
        return json.dumps(good).encode(), {"Content-Type": "text/plain; charset=utf-7"}
    return json.dumps(odd_value(rng)).encode(), json_type


def json_request(rng: random.Random, method: str, path: str, good: dict[str, Any]) -> FuzzRequest:
    """One request to `path`: a mutated `good` body most of the time, else a broken one."""
    if rng.random() < 0.6:
        body = json.dumps(mutate(rng, good)).encode()
        return FuzzRequest(method, path, body, {"Content-Type": "application/json"})
    body, headers = raw_body(rng, good)
    return FuzzRequest(method, path, body, headers)


async def send(client: aiohttp.ClientSession, base: str, r: FuzzRequest) -> tuple[int, str]:
    """Send `r` and check its answer; (status, text) for the caller's own checks."""
    async with client.request(
        r.method,
        base + r.path,
        data=r.body or None,
        headers=r.headers,
        skip_auto_headers=("Content-Type",),
    ) as response:
        text = await response.text(errors="replace")
        status, kind = response.status, response.content_type
    where = f"{r.method} {r.path} {r.headers} {r.body[:120]!r} -> {status} {text[:300]}"
    assert status < 500, where
    if status >= 400:
        assert kind == "application/json" and "error" in json.loads(text), where
    elif kind == "application/json":
        json.loads(text)
    elif kind == "text/event-stream":
        assert text.rstrip().endswith("data: [DONE]"), where
    return status, text
