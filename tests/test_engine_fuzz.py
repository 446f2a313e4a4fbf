"""A bounded fuzz of the engine server: a few hundred malformed and hostile requests (random
JSON shapes, wrong types, huge / negative / non-finite numbers, bad token ids, broken bodies)
against a real app on loopback. Every answer is a 4xx JSON error or a valid 200, never a 500,
and the engine serves a good request afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

from tests.servers import LoopThread, new_serving, serve_engine, tiny_model  # noqa: E402

N_REQUESTS = 300
CONCURRENCY = 16
PROMPT = [40, 41, 42, 43]
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request")
TEMPLATES: dict[str, dict[str, Any]] = {
    "/generate": {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "sampling_seed": 3},
        "rid": "fuzz",
        "return_logprob": True,
        "stream": False,
    },
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 4, "seed": 1},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0.5,
    },
    "/abort_request": {"rid": "fuzz"},
}
KEYS = [
    "input_ids", "text", "sampling_params", "rid", "return_logprob", "stream", "logprob_start_len",
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids",
    "ignore_eos", "sampling_seed", "seed", "prompt", "messages", "max_tokens", "logprobs",
    "stream_options", "chat_template_kwargs", "return_text_in_logprobs", "skip_special_tokens",
    "content", "role", "abort_all", "top_logprobs_num", "token_ids_logprob", "top_logprobs",
    "echo",
]  # fmt: skip
NUMBERS = [
    0, 1, -1, 2, 1.5, -0.5, 1e-9, 1e30, -1e30, 1e308, 2**31, 2**63, 2**64, 2**64 - 1,
    -(2**63) - 1, 10**40, float("nan"), float("inf"), float("-inf"), -0.0, 50_000, 200,
]  # fmt: skip
STRINGS = ["", "yes", "true", "NaN", "fuzz", "a" * 300, "\x00", "é😀", "{}", "[1]"]


def value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 5)
    if kind == 0:
        return rng.choice(NUMBERS)
    if kind == 1:
        return rng.choice(STRINGS)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return [rng.choice([-1, 0, 5, 10**6, 2**70, True, 1.0, "3"]) for _ in range(3)]
    if kind == 4:
        return rng.randrange(-5, 300)
    if kind in (5, 6):
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = rng.sample(KEYS, rng.randrange(4))
    return {k: value(rng, depth + 1) for k in keys}


def mutate(rng: random.Random, body: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randrange(1, 4)):
        target = body
        if depth == 0 and isinstance(body.get("sampling_params"), dict) and rng.random() < 0.4:
            target = body["sampling_params"]
        key = rng.choice([*target.keys(), *KEYS]) if target or rng.random() < 0.5 else "x"
        if rng.random() < 0.15:
            target.pop(key, None)
        elif key == "n":  # a huge n is a resource limit (--max-n), not a validation case
            target[key] = rng.choice([0, -1, 1, 2, 1.5, "2", None, float("nan")])
        else:
            target[key] = value(rng)
    return body


def hostile_bytes(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    good = json.dumps(TEMPLATES["/generate"]).encode()
    return rng.choice(
        [
            (b"", {}),
            (b"null", {}),
            (b"[]", {}),
            (b"7", {}),
            (good[: rng.randrange(1, len(good))], {}),
            (b"[" * 1000 + b"]" * 1000, {}),
            (b'{"input_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}),
            (b'{"text": "\\udc00 x"}', {}),
            (b'{"text": ["ok", "\\ud83d"]}', {}),
            (good, {"Content-Encoding": "gzip"}),
            (good, {"Content-Encoding": "deflate"}),
            (b"\xff\xfe\x00garbage", {}),
            (b'{"input_ids": [1, 2], "input_ids": "dup"}', {}),
        ]
    )


def body_for(rng: random.Random, i: int) -> tuple[str, bytes, dict[str, str]]:
    route = rng.choice(ROUTES)
    if rng.random() < 0.15:
        raw, headers = hostile_bytes(rng)
        return route, raw, headers
    body = mutate(rng, TEMPLATES[route])
    if isinstance(body.get("rid"), str):
        body["rid"] = f"{body['rid']}-{i}"  # concurrent fuzz requests never share a rid
    return route, json.dumps(body).encode(), {}


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"invalid JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def check_answer(route: str, status: int, content_type: str, text: str) -> None:
    assert status < 500, (route, status, text[:300])
    if status == 200:
        if content_type == "text/event-stream":
            for line in text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    strict_json(line[6:])
        elif text:
            strict_json(text)
        return
    assert 400 <= status < 500, (route, status, text[:300])
    body = strict_json(text)
    assert isinstance(body, dict) and ("error" in body or "message" in body), body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoopThread, Any]]:
    model = tiny_model(tmp_path_factory.mktemp("models"))
    loop = LoopThread()
    engine = loop.run(serve_engine(new_serving(model)))
    yield loop, engine
    loop.run(engine.runner.cleanup())
    loop.close()


def test_fuzzed_requests_never_get_a_500(server: tuple[LoopThread, Any]) -> None:
    loop, engine = server
    rng = random.Random(int(os.environ.get("VERST_FUZZ_SEED", "1414")))  # another seed: more
    cases = [body_for(rng, i) for i in range(N_REQUESTS)]

    async def fuzz() -> list[tuple[str, bytes, int, str, str]]:
        limit = asyncio.Semaphore(CONCURRENCY)
        timeout = aiohttp.ClientTimeout(total=30)
        # a new connection per request: the server closes one whose body it could not read
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def one(route: str, raw: bytes, headers: dict[str, str]) -> Any:
                headers = {"Content-Type": "application/json", **headers}
                async with limit, session.post(engine.url + route, data=raw, headers=headers) as r:
                    return route, raw, r.status, r.content_type, await r.text()

            return await asyncio.gather(*(one(*case) for case in cases))

    answers = loop.run(fuzz(), timeout_s=120)
    for route, raw, status, content_type, text in answers:
        try:
            check_answer(route, status, content_type, text)
        except (AssertionError, ValueError) as error:
            raise AssertionError(f"{route} {raw[:300]!r} → {status} {text[:300]}") from error
    statuses = {status for *_, status, _, _ in answers}
    assert 200 in statuses and 400 in statuses  # the fuzz reaches both sides

    async def after() -> tuple[int, int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.get(engine.url + "/health") as r:
                health = r.status
            good = {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            }
            async with session.post(engine.url + "/generate", json=good) as r:
                return health, r.status, await r.json()

    health, status, body = loop.run(after())
    assert health == 200
    assert status == 200 and body["meta_info"]["completion_tokens"] == 3
    assert engine.serving.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}
