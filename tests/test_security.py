"""Security of the verst servers on loopback: API keys on the engine, router and session server
(SGLang's `--api-key` / `--admin-api-key` rules), weights only from allowed directories, bounded
weight-update-group calls, and a router that admits only healthy workers serving the same model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

pytest.importorskip("aiohttp")

import aiohttp  # noqa: E402

from tests.servers import LoopThread, new_serving, start_app, tiny_model  # noqa: E402
from verst.auth import ApiKeys  # noqa: E402
from verst.engine.server.app import make_app  # noqa: E402
from verst.fleet.client import EngineError, HttpEngineClient  # noqa: E402
from verst.sync.buffer_layouts import BUFFERS_PATH  # noqa: E402

KEY, ADMIN = "user-key", "admin-key"
PROMPT = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


async def status_of(
    url: str, path: str, body: Any = None, *, key: str | None = None, method: str = "POST"
) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url + path, json=body, headers=headers) as response:
            await response.read()
            return response.status


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"), "m")


@pytest.fixture(scope="module")
def engine_url(loop: LoopThread, model_dir: Path) -> Iterator[str]:
    """An engine with both keys set."""
    serving = new_serving(model_dir)
    keys = ApiKeys(api_key=KEY, admin_api_key=ADMIN)
    app = make_app(serving, serving.tokenizer, served_model_name="tiny", api_keys=keys)
    runner, url = loop.run(start_app(app))
    yield url
    loop.run(runner.cleanup())


# ---- 9: API keys -----------------------------------------------------------------------------


def test_engine_routes_need_the_key_health_does_not(loop: LoopThread, engine_url: str) -> None:
    assert loop.run(status_of(engine_url, "/health", method="GET")) == 200
    for path, body, method in [
        ("/generate", PROMPT, "POST"),
        ("/model_info", None, "GET"),
        ("/v1/models", None, "GET"),
        ("/v1/loads", None, "GET"),
    ]:
        assert loop.run(status_of(engine_url, path, body, method=method)) == 401, path
        assert loop.run(status_of(engine_url, path, body, method=method, key="wrong")) == 401
        assert loop.run(status_of(engine_url, path, body, method=method, key=KEY)) == 200, path
    # SGLang: with both keys set, ordinary routes take only the API key
    assert loop.run(status_of(engine_url, "/generate", PROMPT, key=ADMIN)) == 401


def test_engine_control_routes_need_the_admin_key(loop: LoopThread, engine_url: str) -> None:
    for path in ("/flush_cache", "/pause_generation", "/continue_generation"):
        assert loop.run(status_of(engine_url, path, {}, key=KEY)) == 401, path
        assert loop.run(status_of(engine_url, path, {}, key=ADMIN)) == 200, path
    body = {"model_path": "/nonexistent", "weight_version": "x"}
    assert loop.run(status_of(engine_url, "/update_weights_from_disk", body, key=KEY)) == 401
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    assert loop.run(status_of(engine_url, "/init_weights_update_group", group, key=KEY)) == 401
    assert loop.run(status_of(engine_url, "/get_weights_by_name", {"name": "x"}, key=KEY)) == 401
    assert loop.run(status_of(engine_url, BUFFERS_PATH, {"buffers": []}, key=KEY)) == 401
    # aborting one's own request is ordinary; aborting everyone's is control
    by_rid = {"rid": "nobody"}
    assert loop.run(status_of(engine_url, "/abort_request", by_rid, key=KEY)) == 200
    every = {"abort_all": True}
    assert loop.run(status_of(engine_url, "/abort_request", every, key=KEY)) == 401
    assert loop.run(status_of(engine_url, "/abort_request", every, key=ADMIN)) == 200


def test_http_engine_client_sends_its_keys(loop: LoopThread, engine_url: str) -> None:
    async def scenario() -> None:
        client = HttpEngineClient(engine_url, api_keys=ApiKeys(KEY, ADMIN))
        open_client = HttpEngineClient(engine_url)
        try:
            out = await client.generate(dict(PROMPT))
            assert isinstance(out, dict) and out["output_ids"]
            assert await client.flush_cache()
            await client.abort_request(abort_all=True)
            assert await client.get_weight_version()
            with pytest.raises(EngineError) as refused:
                await open_client.generate(dict(PROMPT))
            assert refused.value.status == 401
        finally:
            await client.close()
            await open_client.close()

    loop.run(scenario())


def test_keys_come_from_flags_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERST_API_KEY", "from-env")
    monkeypatch.delenv("VERST_ADMIN_API_KEY", raising=False)
    assert ApiKeys.resolve() == ApiKeys("from-env", None)
    assert ApiKeys.resolve("flag", "admin") == ApiKeys("flag", "admin")
    keys = ApiKeys("k")
    assert keys.allows("GET", "/health_generate", None, admin=False)
    assert not keys.allows("GET", "/model_info", "Bearer k2", admin=False)
    assert not keys.allows("GET", "/model_info", "Basic k", admin=False)
    assert keys.allows("GET", "/model_info", "bearer k", admin=False)
    assert keys.allows("POST", "/flush_cache", "Bearer k", admin=True)  # no admin key: API key


def test_serve_warns_without_a_key_beyond_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    from verst.auth import warn_if_open

    warn_if_open("verst serve", "127.0.0.1", ApiKeys())
    warn_if_open("verst serve", "0.0.0.0", ApiKeys("k"))
    assert capsys.readouterr().err == ""
    warn_if_open("verst serve", "0.0.0.0", ApiKeys())
    assert "without an API key" in capsys.readouterr().err


@pytest.fixture(scope="module")
def keyed_stack(loop: LoopThread, engine_url: str, model_dir: Path) -> Iterator[dict[str, str]]:
    """Keyed engine ← router (same keys) ← session server (its own key, the router's upstream)."""
    from transformers import AutoTokenizer

    from verst.router import Router
    from verst.router.server import make_router_app
    from verst.sessions import ChatTokenizer
    from verst.sessions.server import make_session_app

    keys = ApiKeys(api_key=KEY, admin_api_key=ADMIN)
    router_app = make_router_app(Router([engine_url]), health_interval_s=0.1, api_keys=keys)
    router_runner, router_url = loop.run(start_app(router_app))
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    session_app = make_session_app(
        router_url,
        chat,
        model_name="tiny",
        api_keys=ApiKeys(api_key="session-key"),
        upstream_keys=ApiKeys(api_key=KEY),
    )
    session_runner, session_url = loop.run(start_app(session_app))
    yield {"router": router_url, "sessions": session_url}
    loop.run(session_runner.cleanup())
    loop.run(router_runner.cleanup())


def test_router_checks_its_keys_and_sends_the_engines(
    loop: LoopThread, keyed_stack: dict[str, str]
) -> None:
    url = keyed_stack["router"]
    assert loop.run(status_of(url, "/health", method="GET")) == 200
    assert loop.run(status_of(url, "/generate", PROMPT)) == 401
    assert loop.run(status_of(url, "/generate", PROMPT, key=KEY)) == 200
    assert loop.run(status_of(url, "/list_workers", method="GET")) == 401
    # control: the admin key; the router then calls the engines with theirs
    assert loop.run(status_of(url, "/flush_cache", {}, key=KEY)) == 401
    assert loop.run(status_of(url, "/flush_cache", {}, key=ADMIN)) == 200
    assert loop.run(status_of(url, "/add_worker?url=http://127.0.0.1:1", key=KEY)) == 401
    assert loop.run(status_of(url, "/remove_worker?url=http://127.0.0.1:1", key=KEY)) == 401


def test_session_server_checks_its_key(loop: LoopThread, keyed_stack: dict[str, str]) -> None:
    url = keyed_stack["sessions"]
    assert loop.run(status_of(url, "/health", method="GET")) == 200
    assert loop.run(status_of(url, "/sessions", {})) == 401

    async def one_turn() -> int:
        headers = {"Authorization": "Bearer session-key"}
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.post(url + "/sessions", json={}) as r:
                sid = (await r.json())["session_id"]
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with session.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status

    assert loop.run(one_turn()) == 200  # and the session server's upstream call was keyed


def test_launched_engines_get_the_key_through_the_environment(model_dir: Path) -> None:
    from verst.fleet.launcher import launch_local_engines

    keys = ApiKeys(api_key="launch-key")
    (engine,) = launch_local_engines(model_dir, 1, extra_args=["--device", "cpu"], env=keys.env())
    with engine:
        cmdline = Path(f"/proc/{engine.process.pid}/cmdline").read_bytes()
        assert b"launch-key" not in cmdline
        thread = LoopThread()
        try:
            assert thread.run(status_of(engine.url, "/model_info", method="GET")) == 401
            ok = thread.run(status_of(engine.url, "/model_info", method="GET", key="launch-key"))
            assert ok == 200
            # by default weights come only from under the model's parent directory
            body = {"model_path": str(Path(__file__).parent)}
            path = "/update_weights_from_disk"
            assert thread.run(status_of(engine.url, path, body, key="launch-key")) == 400
        finally:
            thread.close()


# ---- 12: the router admits only valid, healthy workers of the same model -----------------------


@pytest.fixture(scope="module")
def open_engines(loop: LoopThread, model_dir: Path) -> Iterator[dict[str, str]]:
    """Three open engines: two alike, one serving another model name, one at another version."""
    urls, runners = {}, []
    for name, served, version in [
        ("a", "tiny", None),
        ("b", "tiny", None),
        ("other_model", "other", None),
        ("other_version", "tiny", "7"),
    ]:
        serving = new_serving(model_dir)
        if version is not None:
            serving.weight_version = version
        runner, urls[name] = loop.run(
            start_app(make_app(serving, serving.tokenizer, served_model_name=served))
        )
        runners.append(runner)
    yield urls
    for runner in runners:
        loop.run(runner.cleanup())


def test_add_worker_validates_checks_health_and_model(
    loop: LoopThread, open_engines: dict[str, str]
) -> None:
    from verst.router import Router
    from verst.router.server import make_router_app

    async def scenario() -> None:
        router = Router([open_engines["a"]])
        runner, url = await start_app(make_router_app(router, health_interval_s=0.05))
        try:
            for bad in [
                "ftp://127.0.0.1:1",
                "http://",
                "http://127.0.0.1:99999",
                "http://127.0.0.1:abc",
                "http://user:pw@127.0.0.1:1",
                "http://127.0.0.1:1/path",
                "http://" + "a" * 300 + ":1",
                "not a url",
            ]:
                status = await status_of(url, "/add_worker?" + urlencode({"url": bad}))
                assert status == 400, bad
            dead = "http://127.0.0.1:9"
            for rejected in (dead, open_engines["other_model"], open_engines["other_version"]):
                status = await status_of(url, "/add_worker?" + urlencode({"url": rejected}))
                assert status == 400, rejected
            assert router.engines == [open_engines["a"]]
            good = "/add_worker?" + urlencode({"url": open_engines["b"]})
            assert await status_of(url, good) == 200
            assert router.engines == [open_engines["a"], open_engines["b"]]
        finally:
            await runner.cleanup()

    loop.run(scenario())


def test_a_malformed_engine_url_never_stops_the_health_checker(
    loop: LoopThread, open_engines: dict[str, str]
) -> None:
    from verst.router import Router
    from verst.router.handlers import HealthChecker

    async def scenario() -> None:
        good = open_engines["a"]
        router = Router(["http://" + "a" * 300 + ":1", good])
        checker = HealthChecker(router, interval_s=0.01, failures=1, timeout_s=1.0)
        router.set_healthy(good, False)
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(checker.run(session))
            for _ in range(200):
                await asyncio.sleep(0.01)
                if router.is_healthy(good):
                    break
            assert not task.done(), "the health checker died"
            task.cancel()
        assert router.is_healthy(good)

    loop.run(scenario())


# ---- 10: weights from disk only under the allowed directories ---------------------------------


def test_weights_from_disk_only_under_allowed_dirs(loop: LoopThread, tmp_path: Path) -> None:
    root, outside = tmp_path / "allowed", tmp_path / "outside"
    good = tiny_model(root, "good", seed=1)
    elsewhere = tiny_model(outside, "elsewhere", seed=2)
    (root / "link").symlink_to(elsewhere)  # a symlink out of the root
    sneaky = root / "sneaky"
    sneaky.mkdir()
    (sneaky / "model.safetensors").symlink_to(next(elsewhere.glob("*.safetensors")))
    junk = root / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"SECRET-BYTES " * 10)

    async def scenario() -> None:
        serving = new_serving(good)
        serving.allowed_weight_dirs = (root,)
        runner, url = await start_app(make_app(serving, serving.tokenizer, served_model_name="t"))

        async def update(path: Path) -> tuple[int, str]:
            async with aiohttp.ClientSession() as session:
                body = {"model_path": str(path)}
                async with session.post(url + "/update_weights_from_disk", json=body) as r:
                    return r.status, (await r.json())["message"]

        try:
            refusals = []
            for path in (elsewhere, outside / "missing", root / "missing", root / "link", sneaky):
                status, message = await update(path)
                assert status == 400, path
                refusals.append(message.replace(str(path), "PATH"))
            assert len(set(refusals)) == 1, refusals  # missing and forbidden look alike
            status, message = await update(junk)
            assert status == 400 and "SECRET" not in message
            assert await update(good) == (200, "Succeeded to update model weights.")
        finally:
            await runner.cleanup()

    loop.run(scenario())


# ---- 11: weight-update groups: control route, bounded, quick to fail, bound to one address -----


def test_group_joins_to_a_dead_port_never_starve_generation(
    loop: LoopThread, model_dir: Path
) -> None:
    from verst.fleet.launcher import free_port

    async def scenario() -> None:
        serving = new_serving(model_dir)
        serving.group_join_timeout_s = 1.0
        runner, url = await start_app(make_app(serving, serving.tokenizer, served_model_name="t"))
        dead = free_port()  # nothing listens there
        group = {"master_address": "127.0.0.1", "master_port": dead, "world_size": 2}

        async def join(i: int) -> tuple[int, Any]:
            body = {**group, "rank_offset": 1, "group_name": f"g{i}", "backend": "gloo"}
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/init_weights_update_group", json=body) as r:
                    return r.status, await r.json()

        try:
            joins = [asyncio.create_task(join(i)) for i in range(8)]
            await asyncio.sleep(0.3)
            started = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(status_of(url, "/generate", PROMPT), 10.0) == 200
            assert asyncio.get_running_loop().time() - started < 5.0
            answers = await asyncio.wait_for(asyncio.gather(*joins), 10.0)
            assert all(status == 400 and not body["success"] for status, body in answers)
        finally:
            await runner.cleanup()

    loop.run(scenario(), timeout_s=60.0)


def test_trainer_store_listens_on_the_given_address_only() -> None:
    import subprocess

    from verst.fleet.launcher import free_port
    from verst.sync.broadcast import create_group

    port = free_port()
    group = create_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=1)
    try:
        listening = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
        bound = [line.split()[3] for line in listening.splitlines()[1:] if f":{port}" in line]
        assert bound == [f"127.0.0.1:{port}"], bound
    finally:
        del group
