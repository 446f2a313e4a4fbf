"""The router: the pure `Router` state (affinity, least-loaded placement, refusals, dead engines,
DP ranks) and the HTTP proxy in front of two real verst engine servers on 127.0.0.1 (affinity
over many requests, spreading of concurrent keys, refusal, failover through the health checker,
fleet-wide control, SSE pass-through)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from verst.router import ROUTING_KEY_HEADER, MissingRoutingKey, NoEngineAvailable, Router
from verst.router.policy import split_rank

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"

# ---- policy ----------------------------------------------------------------------------------


def test_same_key_same_engine_until_released() -> None:
    router = Router([A, B])
    first = router.pick("s1")
    for _ in range(10):
        router.begin(first)  # load on the pinned engine never moves the key
        assert router.pick("s1") == first
    assert router.release("s1") and not router.release("s1")
    assert router.metrics()["active_keys"] == 0
    assert router.pick("s1") != first  # re-placed on the idle engine after the release


def test_new_key_goes_to_least_active_engine() -> None:
    router = Router([A, B, C])
    for _ in range(3):
        router.begin(A)
    router.begin(B)
    assert router.pick("k1") == C
    router.begin(C)
    router.begin(C)
    assert router.pick("k2") == B  # A 3, B 1, C 2
    router.end(A), router.end(A), router.end(A)
    assert router.pick("k3") == A  # A 0 now
    assert router.pick("k1") == C and router.pick("k2") == B  # old keys never move


def test_ties_go_to_fewer_keys_then_first() -> None:
    router = Router([A, B])
    assert router.pick("k1") == A
    assert router.pick("k2") == B  # both idle; B has no key yet
    assert router.pick(None) == A  # key-less: the tie goes to the first registered


def test_keyless_least_loaded_when_sessions_off() -> None:
    router = Router([A, B])
    router.begin(A)
    assert router.pick(None) == B
    assert router.pick("") == B  # an empty key is no key
    assert router.metrics()["active_keys"] == 0


def test_keyless_refused_when_sessions_on() -> None:
    router = Router([A, B], sessions=True)
    with pytest.raises(MissingRoutingKey) as refused:
        router.pick(None)
    assert ROUTING_KEY_HEADER in str(refused.value)
    assert "session affinity" in str(refused.value)
    with pytest.raises(MissingRoutingKey):
        router.pick("")
    assert router.metrics()["refusals"] == 2
    assert router.pick("s") == A  # keyed requests are fine


def test_dead_engine_keys_are_replaced_lazily() -> None:
    router = Router([A, B])
    keys = [f"k{i}" for i in range(6)]
    placed = {k: router.pick(k) for k in keys}
    on_a = [k for k in keys if placed[k] == A]
    assert on_a and len(on_a) < len(keys)
    router.remove_engine(A)
    assert router.metrics()["re_placements"] == 0  # lazily: nothing moves before a request
    for k in keys:
        assert router.pick(k) == B
    assert router.metrics()["re_placements"] == len(on_a)
    router.add_engine(A)  # adding an engine never moves keys
    assert all(router.pick(k) == B for k in keys)
    assert router.pick("new") == A


def test_unhealthy_engine_out_of_routing_and_back() -> None:
    router = Router([A, B])
    assert router.pick("k") == A
    router.set_healthy(A, False)
    assert router.pick("other") == B and router.pick("k") == B
    router.set_healthy(B, False)
    with pytest.raises(NoEngineAvailable):
        router.pick("k")
    router.set_healthy(A, True)
    assert router.pick("k") == A
    metrics = router.metrics()
    assert metrics["re_placements"] == 2 and metrics["no_engine"] == 1
    assert metrics["engines"][B]["healthy"] is False


def test_add_engine_at_runtime_takes_new_keys() -> None:
    router = Router([A])
    router.begin(A)
    assert router.pick("k1") == A
    assert router.add_engine(B) and not router.add_engine(B + "/")
    assert router.pick("k2") == B and router.pick("k1") == A


def test_metrics_count_requests_and_active() -> None:
    router = Router([A, B])
    for key in ("x", "x", "y"):
        router.begin(router.pick(key))
    router.end(A)
    metrics = router.metrics()
    assert metrics["engines"][A] == {"requests": 2, "active": 1, "keys": 1, "healthy": True}
    assert metrics["engines"][B] == {"requests": 1, "active": 1, "keys": 1, "healthy": True}
    assert metrics["requests"] == 3 and metrics["active"] == 2 and metrics["active_keys"] == 2
    router.end("http://gone:9")  # a request on an engine removed meanwhile: ignored


def test_dp_ranks_are_targets() -> None:
    assert split_rank("http://h:5@1") == ("http://h:5", 1)
    assert split_rank("http://h:5/") == ("http://h:5", None)
    assert split_rank("http://user@h:5") == ("http://user@h:5", None)
    r0, r1 = f"{A}@0", f"{A}@1"
    router = Router([r0, r1, B])
    router.begin(B)
    placed = {router.pick(f"k{i}") for i in range(4)}
    assert placed == {r0, r1}
    key_on_r1 = next(f"k{i}" for i in range(4) if router.key_target(f"k{i}") == r1)
    assert all(router.pick(key_on_r1) == r1 for _ in range(5))
    assert router.base_urls() == [A, B]
    router.set_healthy(A, False)  # health is per server: both ranks leave routing
    assert router.live_engines == [B]
    router.remove_engine(A)
    assert router.engines == [B]


# ---- HTTP: the proxy over two real engines ---------------------------------------------------

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from tests.servers import (  # noqa: E402
    Engine,
    LoopThread,
    T,
    call,
    start_app,
    start_engine,
    tiny_model,
)
from verst.router.server import make_router_app  # noqa: E402

HEALTH_INTERVAL_S = 0.05


@dataclass
class Fleet:
    loop: LoopThread
    engines: list[Engine]
    model_dir: Path

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run(coro)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model_dir = tiny_model(tmp_path_factory.mktemp("models"))
    loop = LoopThread()
    engines = [loop.run(start_engine(model_dir)) for _ in range(2)]
    yield Fleet(loop, engines, model_dir)
    for engine in engines:
        loop.run(engine.runner.cleanup())
    loop.close()


@dataclass
class Proxy:
    router: Router
    url: str


@pytest.fixture
def proxy(fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[Proxy]:
    """The router app over both engines; `@pytest.mark.parametrize("proxy", [...])` sets
    sessions on, indirectly."""
    sessions = bool(getattr(request, "param", False))
    router = Router([e.url for e in fleet.engines], sessions=sessions)
    app = make_router_app(router, health_interval_s=HEALTH_INTERVAL_S, health_failures=2)
    runner, url = fleet.run(start_app(app))
    yield Proxy(router, url)
    fleet.run(runner.cleanup())


def generate_body(i: int = 0, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": 4, "temperature": 0}
    return {"input_ids": [40 + i % 7, 41, 42], "sampling_params": params, **extra}


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def test_same_key_reaches_same_engine(fleet: Fleet, proxy: Proxy) -> None:
    async def scenario() -> None:
        for i in range(20):
            status, out = await call(proxy.url, "/generate", generate_body(i), key="session-1")
            assert status == 200 and len(out["output_ids"]) == 4
        status, metrics = await call(proxy.url, "/metrics", method="GET")
        assert status == 200
        counts = sorted(s["requests"] for s in metrics["engines"].values())
        assert counts == [0, 20] and metrics["active_keys"] == 1 and metrics["active"] == 0
        # The OpenAI route follows the key too.
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, _ = await call(proxy.url, "/v1/chat/completions", chat, key="session-1")
        assert status == 200
        target = proxy.router.key_target("session-1")
        assert proxy.router.metrics()["engines"][target]["requests"] == 21
        status, released = await call(proxy.url, "/release_key", {"key": "session-1"})
        assert status == 200 and released == {"key": "session-1", "released": True}
        assert proxy.router.metrics()["active_keys"] == 0

    fleet.run(scenario())


def test_concurrent_keys_spread_over_engines(fleet: Fleet, proxy: Proxy) -> None:
    batches_before = [e.serving.num_batches for e in fleet.engines]

    async def scenario() -> list[tuple[int, Any]]:
        return await asyncio.gather(
            *(call(proxy.url, "/generate", generate_body(i), key=f"k{i}") for i in range(40))
        )

    results = fleet.run(scenario())
    assert all(status == 200 for status, _ in results)
    metrics = proxy.router.metrics()
    per_engine = [metrics["engines"][e.url] for e in fleet.engines]
    assert all(s["keys"] >= 10 for s in per_engine), per_engine
    assert sum(s["requests"] for s in per_engine) == 40
    for engine, before in zip(fleet.engines, batches_before, strict=True):
        assert engine.serving.num_batches > before  # both engines really generated


@pytest.mark.parametrize("proxy", [True], indirect=True)
def test_missing_key_refused_with_sessions(fleet: Fleet, proxy: Proxy) -> None:
    status, body = fleet.run(call(proxy.url, "/generate", generate_body()))
    assert status == 400
    assert body["error"]["code"] == "missing_routing_key"
    assert ROUTING_KEY_HEADER in body["error"]["message"]
    assert "session affinity" in body["error"]["message"]
    status, _ = fleet.run(call(proxy.url, "/generate", generate_body(), key="s"))
    assert status == 200
    status, _ = fleet.run(call(proxy.url, "/v1/models", method="GET"))  # reads need no key
    assert status == 200
    assert proxy.router.metrics()["refusals"] == 1


def test_engine_errors_pass_through(fleet: Fleet, proxy: Proxy) -> None:
    status, body = fleet.run(call(proxy.url, "/generate", {"sampling_params": {}}, key="e"))
    assert status == 400 and "error" in body
    status, _ = fleet.run(call(proxy.url, "/no_such_route", {}, key="e"))
    assert status == 404


def test_sse_stream_passes_through(fleet: Fleet, proxy: Proxy) -> None:
    async def scenario() -> tuple[str, list[str]]:
        headers = {ROUTING_KEY_HEADER: "stream"}
        async with aiohttp.ClientSession() as session:
            body = generate_body(stream=True)
            body["sampling_params"]["ignore_eos"] = True
            async with session.post(proxy.url + "/generate", json=body, headers=headers) as r:
                assert r.status == 200
                lines = [line.decode().strip() async for line in r.content]
                return r.content_type, [line for line in lines if line]

    content_type, events = fleet.run(scenario())
    assert content_type == "text/event-stream"
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    # the engine streams by token (a slow reader gets steps coalesced); the router passes
    # every chunk through
    lengths = [len(c["output_ids"]) for c in chunks]
    assert len(lengths) > 1 and lengths == sorted(set(lengths)) and lengths[-1] == 4


def test_broadcast_reaches_every_engine(fleet: Fleet, proxy: Proxy) -> None:
    status, body = fleet.run(call(proxy.url, "/pause_generation", {"mode": "in_place"}))
    assert status == 200 and body["success"] is True
    assert set(body["engines"]) == {e.url for e in fleet.engines}
    assert all(e.serving.is_paused for e in fleet.engines)
    status, body = fleet.run(call(proxy.url, "/continue_generation", {}))
    assert status == 200 and all(a["status"] == 200 for a in body["engines"].values())
    assert not any(e.serving.is_paused for e in fleet.engines)
    status, body = fleet.run(call(proxy.url, "/update_weights_from_disk", {}))
    assert status == 400 and body["success"] is False  # the engines' own 400, each shown
    assert all(a["status"] == 400 for a in body["engines"].values())


def test_failover_after_health_checks(fleet: Fleet) -> None:
    """A third engine dies: the health checker takes it out and its keys move to a live one."""

    async def scenario() -> None:
        doomed = await start_engine(fleet.model_dir)
        live = fleet.engines[0]
        router = Router([live.url, doomed.url])
        app = make_router_app(router, health_interval_s=HEALTH_INTERVAL_S, health_failures=2)
        runner, url = await start_app(app)
        try:
            router.begin(live.url)  # a busy live engine: new keys go to the doomed one
            keys = [f"f{i}" for i in range(3)]
            for key in keys:
                assert (await call(url, "/generate", generate_body(), key=key))[0] == 200
            assert all(router.key_target(k) == doomed.url for k in keys)
            router.end(live.url)
            await doomed.runner.cleanup()
            await wait_until(lambda: not router.is_healthy(doomed.url))
            for key in keys:
                status, out = await call(url, "/generate", generate_body(), key=key)
                assert status == 200 and len(out["output_ids"]) == 4
            assert all(router.key_target(k) == live.url for k in keys)
            status, workers = await call(url, "/workers", method="GET")
            health = {w["url"]: w["healthy"] for w in workers["workers"]}
            assert health == {live.url: True, doomed.url: False}
            metrics = router.metrics()
            assert metrics["re_placements"] == 3
            # Broadcasts still address the dead engine, and say so.
            status, body = await call(url, "/flush_cache", {})
            assert status == 502 and body["engines"][doomed.url]["status"] is None
            assert (await call(url, "/remove_worker?url=" + doomed.url))[0] == 200
            assert router.engines == [live.url]
        finally:
            await runner.cleanup()

    fleet.run(scenario())


def test_unreachable_engine_is_502_and_marked_down(fleet: Fleet) -> None:
    async def scenario() -> None:
        dead = "http://127.0.0.1:9"  # discard port: nothing listens
        router = Router([dead])
        app = make_router_app(router, health_interval_s=30.0)
        runner, url = await start_app(app)
        try:
            status, body = await call(url, "/generate", generate_body(), key="k")
            assert status == 502 and body["error"]["code"] == "bad_gateway"
            assert not router.is_healthy(dead)
            status, body = await call(url, "/generate", generate_body(), key="k")
            assert status == 503 and body["error"]["code"] == "no_available_workers"
            assert (await call(url, "/health", method="GET"))[0] == 503
            # A worker added at runtime takes the traffic at once.
            live = fleet.engines[1].url
            assert (await call(url, f"/add_worker?url={live}"))[0] == 200
            assert (await call(url, "/generate", generate_body(), key="k"))[0] == 200
            assert router.key_target("k") == live
            assert (await call(url, "/health", method="GET"))[0] == 200
        finally:
            await runner.cleanup()

    fleet.run(scenario())


def test_dp_rank_is_sent_in_the_body(fleet: Fleet) -> None:
    """`@rank` is stripped from the URL and sent as SGLang's `routed_dp_rank` on /generate."""
    seen: list[Any] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append((request.path, await request.json()))
        return web.json_response({"ok": True})

    async def scenario() -> None:
        fake = web.Application()  # a DP-2 engine verst does not ship: only the body matters
        fake.router.add_post("/generate", echo)
        fake_runner, fake_url = await start_app(fake)
        real = fleet.engines[0].url
        router = Router([f"{fake_url}@1", f"{real}@0"])
        router.begin(f"{real}@0")
        runner, url = await start_app(make_router_app(router, health_interval_s=30.0))
        try:
            assert (await call(url, "/generate", generate_body(), key="r1"))[0] == 200
            assert seen == [("/generate", {**generate_body(), "routed_dp_rank": 1})]
            router.end(f"{real}@0")
            router.begin(f"{fake_url}@1")
            status, out = await call(url, "/generate", generate_body(), key="r0")
            assert status == 200 and "output_ids" in out  # the verst engine accepts rank 0
            assert router.key_target("r0") == f"{real}@0"
        finally:
            await runner.cleanup()
            await fake_runner.cleanup()

    fleet.run(scenario())


def test_cli_route_needs_engines(capsys: pytest.CaptureFixture[str]) -> None:
    from verst.cli import main

    assert main(["route", "--engines", " , "]) == 2
    assert "at least one engine URL" in capsys.readouterr().err
