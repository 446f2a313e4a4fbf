"""A bounded fuzz of `verst sessions` on loopback: a few hundred malformed requests (odd types
in every chat field and message, broken JSON, deep nesting, lone surrogates, fake gzip, wrong
methods) to every route. Every answer is a 4xx JSON error or a valid 2xx, never a 5xx, and a
good chat still works afterwards.

The upstream is a stub `/generate` that answers one token and the end of turn (and refuses a
negative temperature with 400, as an engine would): the engine has its own fuzz test."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("transformers")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tests.fuzz_requests import FuzzRequest, json_request, odd_value, send  # noqa: E402
from tests.servers import LoopThread, call, start_app, tiny_model  # noqa: E402
from verst.http_limits import HttpLimits  # noqa: E402
from verst.sessions import ChatTokenizer  # noqa: E402
from verst.sessions.server import make_session_app  # noqa: E402
from verst.sessions.store import SessionStore  # noqa: E402

REQUESTS = 300
GOOD_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "temperature": 0,
}


def stub_generate(end_of_turn_id: int) -> Any:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        params = body["sampling_params"]
        if params.get("temperature", 1) < 0:
            return web.json_response({"error": {"message": "temperature < 0"}}, status=400)
        ids = [5, end_of_turn_id]
        meta = {
            "output_token_logprobs": [[-0.5, i, None] for i in ids],
            "finish_reason": {"type": "stop"},
            "weight_version": "0",
            "cached_tokens": 0,
        }
        return web.json_response({"text": "x", "output_ids": ids, "meta_info": meta})

    return generate


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LoopThread]]:
    model_dir = tiny_model(tmp_path_factory.mktemp("models"))
    chat_tokenizer = ChatTokenizer(AutoTokenizer.from_pretrained(str(model_dir)))
    loop = LoopThread()
    stub = web.Application()
    stub.router.add_post("/generate", stub_generate(chat_tokenizer.format.end_of_turn_id))
    stub_runner, stub_url = loop.run(start_app(stub))
    limits = HttpLimits(max_body_mb=0.05)
    store = SessionStore(chat_tokenizer, max_sessions=50)
    app = make_session_app(stub_url, chat_tokenizer, model_name="tiny", store=store, limits=limits)
    runner, url = loop.run(start_app(app, limits))
    yield url, loop
    loop.run(runner.cleanup())
    loop.run(stub_runner.cleanup())
    loop.close()


def odd_message(rng: random.Random) -> Any:
    message: dict[str, Any] = {"role": rng.choice(["user", "assistant", "tool", "system", 1])}
    for key in rng.sample(["content", "tool_calls", "name", "tool_call_id"], rng.randint(0, 3)):
        message[key] = odd_value(rng)
    if rng.random() < 0.3:
        message["content"] = [{"type": "text", "text": odd_value(rng)}]
    return message if rng.random() < 0.9 else odd_value(rng)


def fuzz_requests(rng: random.Random, sids: list[str]) -> list[FuzzRequest]:
    requests = []
    for _ in range(REQUESTS):
        sid = rng.choice(sids + ["nope", "..", "%00"])
        kind = rng.random()
        if kind < 0.6:
            good = {**GOOD_CHAT}
            if rng.random() < 0.5:
                good["messages"] = [odd_message(rng) for _ in range(rng.randint(0, 3))]
            r = json_request(rng, "POST", f"/sessions/{sid}/v1/chat/completions", good)
        elif kind < 0.75:
            r = json_request(rng, "POST", f"/sessions/{sid}/samples", {"max_seq_len": 64})
        elif kind < 0.85:
            r = json_request(rng, "POST", "/sessions", {})
        else:
            method = rng.choice(["GET", "DELETE", "PUT", "PATCH", "POST"])
            path = rng.choice([f"/sessions/{sid}", "/health", "/sessions", "/nowhere"])
            r = FuzzRequest(method, path)
        if rng.random() < 0.02:
            r = FuzzRequest(r.method, r.path, b"x" * 60_000, r.headers)  # over the body limit
        requests.append(r)
    return requests


def test_sessions_fuzz(sessions: tuple[str, LoopThread]) -> None:
    url, loop = sessions
    rng = random.Random(14)

    async def scenario() -> dict[int, int]:
        sids = [(await call(url, "/sessions"))[1]["session_id"] for _ in range(4)]
        statuses: dict[int, int] = {}
        async with aiohttp.ClientSession() as client:
            for r in fuzz_requests(rng, sids):
                status, text = await send(client, url, r)
                statuses[status] = statuses.get(status, 0) + 1
                if r.method == "POST" and r.path == "/sessions" and status == 200:
                    await call(url, f"/sessions/{json.loads(text)['session_id']}", method="DELETE")
        return statuses

    statuses = loop.run(scenario(), timeout_s=120)
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 50, statuses
    sid = loop.run(call(url, "/sessions"))[1]["session_id"]
    status, body = loop.run(call(url, f"/sessions/{sid}/v1/chat/completions", GOOD_CHAT))
    assert status == 200 and body["choices"][0]["message"]["content"] == "x", body
