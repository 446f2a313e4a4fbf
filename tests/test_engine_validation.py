"""The engine server under hostile input: every bad field is a 400 with a message at the edge,
and nothing one request does can stop the serving loop or fail the requests batched with it."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

from tests.servers import LoopThread, new_serving, serve_engine, tiny_model  # noqa: E402
from verst.engine import SamplingParams  # noqa: E402
from verst.engine.serving import ServingEngine  # noqa: E402

PROMPT = [40, 41, 42, 43]
GREEDY = {"max_new_tokens": 4, "temperature": 0}


@dataclass
class Server:
    loop: LoopThread
    serving: ServingEngine
    url: str

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        return self.loop.run(post(self.url + path, body, **kw))


async def post(url: str, body: Any, *, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=data, headers=headers) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text) if text else None
            except ValueError:
                return response.status, text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_model(tmp_path_factory.mktemp("models"))
    loop = LoopThread()
    serving = new_serving(model)
    engine = loop.run(serve_engine(serving))
    yield Server(loop, serving, engine.url)
    loop.run(engine.runner.cleanup())
    loop.close()


def healthy(server: Server) -> None:
    """/health is 200, a good request answers, and nothing is left running."""

    async def check() -> tuple[int, int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/health") as response:
                health = response.status
        status, body = await post(
            server.url + "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}
        )
        return health, status, body

    health, status, body = server.loop.run(check())
    assert health == 200
    assert status == 200, body
    assert body["meta_info"]["completion_tokens"] == 4
    assert server.serving.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}


def message(body: Any) -> str:
    error = body["error"] if "error" in body else body["message"]
    return error["message"] if isinstance(error, dict) else str(error)


BAD_SEEDS = [1.5, 2**64, -1, -(2**63) - 1, 1e30, True, "7"]


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_a_bad_sampling_seed_is_a_400_and_the_engine_lives_on(server: Server, seed: Any) -> None:
    params = {**GREEDY, "temperature": 1.0, "sampling_seed": seed}
    status, body = server.post("/generate", {"input_ids": PROMPT, "sampling_params": params})
    assert status == 400, body
    assert "sampling_seed" in message(body)
    status, body = server.post("/v1/completions", {"prompt": PROMPT, "seed": seed})
    assert status == 400, body
    healthy(server)


def test_the_largest_seed_and_its_n_samples_are_served(server: Server) -> None:
    params = {**GREEDY, "temperature": 1.0, "sampling_seed": 2**64 - 1, "n": 2}
    status, body = server.post("/generate", {"input_ids": PROMPT, "sampling_params": params})
    assert status == 200, body
    assert len(body) == 2


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("temperature", "-Infinity"),
        ("temperature", -0.5),
        ("top_p", "NaN"),
        ("min_p", "NaN"),
        ("max_new_tokens", "Infinity"),
        ("max_new_tokens", 1.5),
        ("top_k", "NaN"),
    ],
)
def test_non_finite_and_negative_sampling_numbers_are_400(
    server: Server, field: str, value: Any
) -> None:
    # json.dumps cannot write NaN as a string the server reads as a number: splice it in.
    raw = f'{{"input_ids": {PROMPT}, "sampling_params": {{"{field}": {json.dumps(value)}}}}}'
    raw = raw.replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
    raw = raw.replace('"-Infinity"', "-Infinity")
    status, body = server.post("/generate", raw.encode())
    assert status == 400, body
    assert field in message(body)
    openai_field = {"max_new_tokens": "max_tokens"}.get(field, field)
    raw = f'{{"prompt": {PROMPT}, "{openai_field}": {json.dumps(value)}}}'
    raw = raw.replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
    raw = raw.replace('"-Infinity"', "-Infinity")
    for path in ("/v1/completions", "/v1/chat/completions"):
        body_raw = raw if "completions" in path and "chat" not in path else raw
        if "chat" in path:
            body_raw = raw.replace(
                '"prompt"', '"messages": [{"role": "user", "content": "hi"}], "unused"'
            )
        status, body = server.post(path, body_raw.encode())
        assert status == 400, (path, body)
    healthy(server)


def test_engine_side_validation_rejects_what_the_edge_would() -> None:
    for params in (
        SamplingParams(temperature=math.nan),
        SamplingParams(temperature=math.inf),
        SamplingParams(sampling_seed=2**64),
        SamplingParams(sampling_seed=-1),
        SamplingParams(sampling_seed=True),  # type: ignore[arg-type]
        SamplingParams(sampling_seed=1.5),  # type: ignore[arg-type]
        SamplingParams(max_new_tokens=1.5),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError):
            params.validate()


def test_the_loop_survives_a_request_that_raises_inside_it(server: Server) -> None:
    """An exception raised for one request inside the serving loop fails that request only."""
    serving = server.serving
    real = serving.scheduler.submit

    def submit(request: Any) -> None:
        if request.rid.startswith("poison"):
            raise RuntimeError("injected failure")
        real(request)

    serving.scheduler.submit = submit  # type: ignore[method-assign]
    try:

        async def both() -> list[Any]:
            return await asyncio.gather(
                post(server.url + "/generate", {"input_ids": PROMPT, "rid": "poison"}),
                *(
                    post(server.url + "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
                    for _ in range(3)
                ),
            )

        (bad, bad_body), *good = server.loop.run(both())
    finally:
        del serving.scheduler.submit
    assert bad >= 400 and "injected failure" in message(bad_body)
    assert [status for status, _ in good] == [200, 200, 200]
    healthy(server)


def test_a_second_in_flight_request_with_the_same_rid_is_400(server: Server) -> None:
    async def twice() -> list[Any]:
        first = asyncio.ensure_future(
            post(
                server.url + "/generate",
                {"input_ids": PROMPT, "rid": "dup", "sampling_params": {"max_new_tokens": 64}},
            )
        )
        for _ in range(400):
            if (
                server.serving.load()["num_running_reqs"]
                + server.serving.load()["num_waiting_reqs"]
            ):
                break
            await asyncio.sleep(0.005)
        second = await post(server.url + "/generate", {"input_ids": PROMPT, "rid": "dup"})
        return [await first, second]

    (first, first_body), (second, second_body) = server.loop.run(twice())
    assert first == 200, first_body
    assert second == 400, second_body
    assert "Duplicate request ID" in message(second_body)
    # A rid is free again once its request has ended.
    status, _ = server.post(
        "/generate", {"input_ids": PROMPT, "rid": "dup", "sampling_params": GREEDY}
    )
    assert status == 200
    healthy(server)


@pytest.mark.parametrize("ids", [[-1], [10**6], [40, 10**9], [[40], [-5]], [2**70]], ids=repr)
def test_out_of_vocabulary_token_ids_are_400_and_fail_no_one_else(
    server: Server, ids: list[Any]
) -> None:
    async def mixed() -> list[Any]:
        return await asyncio.gather(
            post(server.url + "/generate", {"input_ids": ids, "sampling_params": GREEDY}),
            *(
                post(server.url + "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
                for _ in range(5)
            ),
        )

    (bad, body), *good = server.loop.run(mixed())
    assert bad == 400, body
    assert "vocab" in message(body)
    assert [status for status, _ in good] == [200] * 5
    status, body = server.post("/v1/completions", {"prompt": ids, "max_tokens": 2})
    assert status == 400, body
    healthy(server)


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [True, False]},
        {"input_ids": [[True]]},
        {"input_ids": PROMPT, "stream": "yes"},
        {"input_ids": PROMPT, "return_logprob": "yes"},
        {"input_ids": PROMPT, "sampling_params": {"ignore_eos": "no"}},
        {"input_ids": PROMPT, "sampling_params": {"stop_token_ids": [True]}},
        {"input_ids": PROMPT, "sampling_params": {"stop_token_ids": [-3]}},
        {"input_ids": PROMPT, "rid": 5},
        {"input_ids": PROMPT, "rid": {"a": 1}},
        {"text": "\ud800"},
    ],
    ids=repr,
)
def test_loose_types_are_400(server: Server, body: dict[str, Any]) -> None:
    status, answer = server.post("/generate", body)
    assert status == 400, answer
    assert message(answer)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": [[True, 3]]}),
        ("/v1/completions", {"prompt": [["a"]]}),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
        ("/v1/chat/completions", {"input_ids": ["x"], "messages": []}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": 3},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]},
        ),
    ],
    ids=repr,
)
def test_openai_loose_types_are_400(server: Server, path: str, body: dict[str, Any]) -> None:
    status, answer = server.post(path, body)
    assert status == 400, answer


def test_hostile_bodies_are_400_with_a_message(server: Server) -> None:
    deep = b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = b"[" * 1000 + b"]" * 1000
    for raw, headers in (
        (deep, None),
        (nested, None),
        (b'{"text": "\\ud800"}', None),
        (b'{"text": "a\\udfff b"}', None),
        (b"not gzip at all", {"Content-Encoding": "gzip"}),
        (b"not deflate", {"Content-Encoding": "deflate"}),
    ):
        status, body = server.post("/generate", raw, headers=headers)
        assert 400 <= status < 500, (raw[:40], status, body)
        assert isinstance(body, dict) and message(body), body
    healthy(server)
