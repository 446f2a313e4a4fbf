"""What the servers promise a hostile or careless client (issue 14, items 6–8): a client that
disconnects stops its generation, through the router too; bodies, `n`, slow and idle clients
and sessions are bounded (413 / 400 / 408 / close / 429); tokenizing never stalls the event
loop; malformed chat bodies and an engine's refusals reach the client as 4xx with a message."""

from __future__ import annotations

import asyncio
import gzip
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from tests.servers import (  # noqa: E402
    LoopThread,
    call,
    new_serving,
    serve_engine,
    start_app,
    tiny_config,
    tiny_model,
)
from verst.engine.server.app import make_app  # noqa: E402
from verst.engine.serving import ServingEngine  # noqa: E402
from verst.http_limits import HttpLimits  # noqa: E402
from verst.router import Router  # noqa: E402
from verst.router.server import make_router_app  # noqa: E402
from verst.sessions import ChatTokenizer  # noqa: E402
from verst.sessions.server import make_session_app  # noqa: E402
from verst.sessions.store import SessionStore  # noqa: E402

# Long enough a context that one request generates for seconds on a CPU.
TINY = tiny_config(max_position_embeddings=4096)
LONG = {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"), config=TINY)


@pytest.fixture(scope="module")
def engine(loop: LoopThread, model_dir: Path) -> Iterator[Any]:
    e = loop.run(serve_engine(new_serving(model_dir)))
    yield e
    loop.run(e.runner.cleanup())


async def _idle(serving: ServingEngine, within_s: float) -> bool:
    """True once nothing runs or waits in the engine, its scheduler included."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        load = serving.load()
        if not any(load.values()) and not serving.scheduler.has_work():
            return True
        await asyncio.sleep(0.05)
    return False


async def _leave_after(url: str, body: dict[str, Any], after_s: float) -> None:
    """Send `body` to `url` and close the connection after `after_s`, unanswered."""

    async def ask(client: aiohttp.ClientSession) -> None:
        async with client.post(url, json=body) as r:
            await r.read()

    async with aiohttp.ClientSession() as client:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ask(client), after_s)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_aborts_its_request(
    loop: LoopThread, engine: Any, stream: bool
) -> None:
    async def scenario() -> None:
        # Eight prompts of 4000 tokens each take seconds; the client leaves after 0.3 s.
        prompts = [[1, 2, i] for i in range(8)]
        body = {"input_ids": prompts, "sampling_params": LONG, "stream": stream}
        await _leave_after(engine.url + "/generate", body, 0.3)
        assert await _idle(engine.serving, 1.0), engine.serving.load()
        # The engine still answers.
        ok = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        assert (await call(engine.url, "/generate", ok))[0] == 200

    loop.run(scenario())


def test_a_weight_update_runs_to_its_end_when_its_client_leaves(
    loop: LoopThread, engine: Any, model_dir: Path
) -> None:
    """Only generation is cancelled by a disconnect: a weight update waiting for a running
    request must not be cut off half-way (that left the engine refusing every request)."""

    async def scenario() -> None:
        body = {"input_ids": [7, 8, 9], "sampling_params": {**LONG, "max_new_tokens": 2000}}
        running = asyncio.create_task(call(engine.url, "/generate", body))
        while not engine.serving.load()["num_running_reqs"]:  # the update must wait for it
            await asyncio.sleep(0.01)
        update = {"model_path": str(model_dir), "weight_version": "after-leave"}
        await _leave_after(engine.url + "/update_weights_from_disk", update, 0.2)
        assert (await running)[0] == 200
        ok = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        status, answer = await asyncio.wait_for(call(engine.url, "/generate", ok), 10.0)
        assert status == 200 and answer["meta_info"]["weight_version"] == "after-leave"

    loop.run(scenario())


def test_the_router_aborts_when_its_client_disconnects(loop: LoopThread, engine: Any) -> None:
    async def scenario() -> None:
        router = Router([engine.url])
        runner, url = await start_app(make_router_app(router, health_interval_s=30.0))
        try:
            prompts = [[4, 5, i] for i in range(8)]
            body = {"input_ids": prompts, "sampling_params": LONG, "rid": "leaver"}
            await _leave_after(url + "/generate", body, 0.3)
            assert await _idle(engine.serving, 1.0), engine.serving.load()
        finally:
            await runner.cleanup()

    loop.run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_the_router_forwards_the_abort_by_rid(loop: LoopThread, stream: bool) -> None:
    """An engine that does not watch its connections still gets `/abort_request` for the rid,
    whether the client left while waiting or in the middle of a stream."""
    aborted: list[Any] = []

    async def slow_generate(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(300):
                await response.write(b'data: {"text": ""}\n\n')
                await asyncio.sleep(0.1)
            return response
        await asyncio.sleep(30)
        return web.json_response({})

    async def abort(request: web.Request) -> web.Response:
        aborted.append(await request.json())
        return web.Response()

    async def scenario() -> None:
        fake = web.Application()
        fake.router.add_post("/generate", slow_generate)
        fake.router.add_post("/abort_request", abort)
        # No handler cancellation: it never notices that the router hung up.
        fake_runner = web.AppRunner(fake, shutdown_timeout=0.1)
        await fake_runner.setup()
        site = web.TCPSite(fake_runner, "127.0.0.1", 0)
        await site.start()
        fake_url = f"http://127.0.0.1:{fake_runner.addresses[0][1]}"
        runner, url = await start_app(make_router_app(Router([fake_url]), health_interval_s=30))
        try:
            body = {"text": "hi", "rid": ["a-1", "a-2"], "stream": stream}
            await _leave_after(url + "/generate", body, 0.3)
            for _ in range(40):
                if len(aborted) == 2:
                    break
                await asyncio.sleep(0.05)
            assert aborted == [{"rid": "a-1"}, {"rid": "a-2"}]
        finally:
            await runner.cleanup()
            await fake_runner.cleanup()

    loop.run(scenario())


# ---- limits ---------------------------------------------------------------------------------

SMALL = HttpLimits(max_body_mb=0.01, read_timeout_s=0.5, idle_timeout_s=0.5)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _raw(url: str, data: bytes, wait_s: float = 3.0) -> bytes:
    """Send raw bytes on a fresh connection; what came back until the server closed or
    `wait_s` passed."""
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=wait_s) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


@pytest.fixture(scope="module")
def small_servers(loop: LoopThread, engine: Any) -> Iterator[dict[str, str]]:
    """The three servers, each under `SMALL` limits (the engine also with max_n 4)."""
    serving = engine.serving

    async def setup() -> list[tuple[web.AppRunner, str]]:
        tok = serving.tokenizer
        engine_app = make_app(serving, tok, served_model_name="t", limits=SMALL, max_n=4)
        engine_app.cleanup_ctx.clear()  # the module's engine fixture owns `serving`
        router_app = make_router_app(Router([engine.url]), health_interval_s=30, limits=SMALL)
        sessions_app = make_session_app(
            engine.url,
            ChatTokenizer(tok),
            model_name="t",
            store=SessionStore(ChatTokenizer(tok), max_sessions=2),
            limits=SMALL,
        )
        return [await start_app(app, SMALL) for app in (engine_app, router_app, sessions_app)]

    started = loop.run(setup())
    yield dict(zip(("engine", "router", "sessions"), (url for _, url in started), strict=True))
    for runner, _ in started:
        loop.run(runner.cleanup())


@pytest.mark.parametrize("server", ["engine", "router", "sessions"])
def test_body_size_read_and_idle_timeouts(
    loop: LoopThread, small_servers: dict[str, str], server: str
) -> None:
    url = small_servers[server]
    path = "/sessions" if server == "sessions" else "/generate"
    big = {"text": "x" * 20_000}
    assert loop.run(call(url, path, big))[0] == 413
    # A body that never arrives whole: 408 once the read timeout passed.
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    started = time.monotonic()
    answer = _raw(url, (head + "Content-Length: 100\r\n\r\n{").encode())
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 2.5
    # Headers that never end, and a connection that never says anything, are closed.
    for silent in (b"GET /health HTTP/1.1\r\nHo", b""):
        started = time.monotonic()
        assert _raw(url, silent, wait_s=5.0) == b""
        assert time.monotonic() - started < 2.5
    # An idle keep-alive connection is closed.
    started = time.monotonic()
    answer = _raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", wait_s=5.0)
    assert answer.startswith(b"HTTP/1.1 ") and time.monotonic() - started < 2.5
    # A fake gzip body is a 400.
    fake = head + "Content-Encoding: gzip\r\nContent-Length: 9\r\nConnection: close\r\n\r\n"
    answer = _raw(url, fake.encode() + b"notgzip!!")
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    # A real gzip body still works where the server reads JSON.
    if server == "sessions":
        packed = gzip.compress(b"{}")
        real = head + f"Content-Encoding: gzip\r\nContent-Length: {len(packed)}\r\n"
        answer = _raw(url, (real + "Connection: close\r\n\r\n").encode() + packed)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_n_has_an_upper_bound(loop: LoopThread, small_servers: dict[str, str]) -> None:
    url = small_servers["engine"]
    for body, path in [
        ({"input_ids": [1], "sampling_params": {"n": 8192}}, "/generate"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"n": 5}]}, "/generate"),
        ({"prompt": "hi", "n": 5, "max_tokens": 1}, "/v1/completions"),
    ]:
        status, answer = loop.run(call(url, path, body))
        assert status == 400 and "max-n" in str(answer), answer
    ok = {"input_ids": [1], "sampling_params": {"n": 4, "max_new_tokens": 1}}
    status, answer = loop.run(call(url, "/generate", ok))
    assert status == 200 and len(answer) == 4


def test_session_count_is_bounded_and_sessions_expire(
    loop: LoopThread, small_servers: dict[str, str]
) -> None:
    url = small_servers["sessions"]
    sids = []
    for _ in range(3):
        status, body = loop.run(call(url, "/sessions"))
        if status != 200:
            break
        sids.append(body["session_id"])
    assert status == 429 and body["error"]["code"] == "too_many_sessions"
    for sid in sids:
        assert loop.run(call(url, f"/sessions/{sid}", method="DELETE"))[0] == 200


def test_sessions_expire(engine: Any) -> None:
    store = SessionStore(ChatTokenizer(engine.serving.tokenizer), ttl_s=0.2, max_sessions=1)
    old = store.create()
    time.sleep(0.3)
    with pytest.raises(Exception, match="no session"):
        store.get(old.session_id)
    store.create()  # the expired one no longer counts
    time.sleep(0.3)
    store.create()  # dropped on create too
    assert len(store.sessions) == 1


class SlowTokenizer:
    """The engine's tokenizer, one second slower per encode: the event loop must not wait."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        time.sleep(1.0)
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def test_tokenizing_does_not_stall_the_event_loop(loop: LoopThread, engine: Any) -> None:
    async def scenario() -> None:
        serving = engine.serving
        app = make_app(serving, SlowTokenizer(serving.tokenizer), served_model_name="t")
        app.cleanup_ctx.clear()
        runner, url = await start_app(app)
        try:
            body = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
            slow = asyncio.create_task(call(url, "/generate", body))
            await asyncio.sleep(0.2)
            started = time.monotonic()
            assert (await call(url, "/health", method="GET"))[0] == 200
            assert time.monotonic() - started < 0.5
            assert (await slow)[0] == 200
        finally:
            await runner.cleanup()

    loop.run(scenario())


# ---- malformed chat bodies and upstream refusals ----------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"stop": 5},
        {"stop": ["a", 1]},
        {"max_tokens": "5"},
        {"temperature": True},
        {"stream": "yes"},
        {"stop_token_ids": [1.5]},
        {"tools": "none"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
    ],
)
def test_loose_chat_types_are_400(
    loop: LoopThread, small_servers: dict[str, str], extra: dict[str, Any]
) -> None:
    url = small_servers["sessions"]
    sid = loop.run(call(url, "/sessions"))[1]["session_id"]
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
        status, answer = loop.run(call(url, f"/sessions/{sid}/v1/chat/completions", body))
        assert status == 400 and answer["error"]["message"], answer
    finally:
        loop.run(call(url, f"/sessions/{sid}", method="DELETE"))


@pytest.mark.parametrize(
    "raw",
    [b"[" * 5000 + b"]" * 5000, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'],
    ids=["deep", "lone-surrogate"],
)
def test_deep_json_and_lone_surrogates_are_400(
    loop: LoopThread, small_servers: dict[str, str], raw: bytes
) -> None:
    url = small_servers["sessions"]

    async def post() -> int:
        sid = (await call(url, "/sessions"))[1]["session_id"]
        try:
            async with aiohttp.ClientSession() as client:
                path = f"{url}/sessions/{sid}/v1/chat/completions"
                headers = {"Content-Type": "application/json"}
                async with client.post(path, data=raw, headers=headers) as r:
                    assert "error" in await r.json()
                    return r.status
        finally:
            await call(url, f"/sessions/{sid}", method="DELETE")

    assert loop.run(post()) == 400


def test_an_engine_refusal_passes_through_as_4xx(
    loop: LoopThread, small_servers: dict[str, str]
) -> None:
    url = small_servers["sessions"]
    sid = loop.run(call(url, "/sessions"))[1]["session_id"]
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "top_p": 5.0}
        status, answer = loop.run(call(url, f"/sessions/{sid}/v1/chat/completions", body))
        assert status == 400 and answer["error"]["code"] == "upstream_rejected", answer
        assert "top_p" in answer["error"]["message"]
    finally:
        loop.run(call(url, f"/sessions/{sid}", method="DELETE"))
