"""verst's whole-update request (`verst.sync.buffer_layouts`): the colocated transport updates a
verst engine in one request (pause, flush, every staging buffer, version, continue), sends each
buffer's layout once, re-sends it when it changed or the engine forgot it, and leaves an SGLang
server on SGLang's calls. On the CPU, through /dev/shm buffers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from verst.engine.serving import ServingEngine
from verst.fleet import InProcessEngineClient
from verst.sync.buffer_layouts import BUFFERS_PATH
from verst.sync.ipc import IpcBucketSender, SharedTensorError
from verst.sync.protocol import WeightSync, WeightSyncError

aiohttp = pytest.importorskip("aiohttp")
web = pytest.importorskip("aiohttp.web")

from tests.servers import call, serve_engine, start_app, tiny_model  # noqa: E402
from verst.fleet import HttpEngineClient  # noqa: E402

ALL_IN_TWO = 1 << 20  # the tiny model fits one bucket: one request a push


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return tiny_model(root, "a", seed=0), tiny_model(root, "b", seed=5)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


class Logged:
    """A real client whose calls are logged with their first argument (the body)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.log = inner, []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)

        async def logged(*args: Any, **kwargs: Any) -> Any:
            self.log.append((name, args[0] if args else None))
            return await attr(*args, **kwargs)

        return logged

    def bodies(self, name: str = "update_weights_from_buffers") -> list[dict[str, Any]]:
        return [body for call_name, body in self.log if call_name == name]


async def _engine(model_dir: Path, device: str = "cpu") -> ServingEngine:
    serving = ServingEngine.from_model_dir(
        str(model_dir), seed=0, kv_cache_bytes=8 << 20, device=device
    )
    await serving.start()
    return serving


def _holds(serving: ServingEngine, weights: dict[str, torch.Tensor]) -> bool:
    params = serving.scheduler.parameters()
    return all(torch.equal(params[n].detach(), t) for n, t in weights.items())


def test_one_request_a_push_and_the_layout_sent_once(models: tuple[Path, Path]) -> None:
    trainer = _weights(models[1])

    async def scenario() -> None:
        serving = await _engine(models[0])
        client = Logged(InProcessEngineClient(serving, owns_serving=True))
        sender = IpcBucketSender(bucket_bytes=ALL_IN_TWO)
        sync = WeightSync([client], sender, pause_mode="retract")
        for version in range(1, 5):  # bit-exact after each of several updates
            weights = {n: t * version for n, t in trainer.items()}
            report = await sync.push(lambda w=weights: w.items(), version)
            assert report.calls == ["update"]
            assert _holds(serving, weights) and serving.weight_version == str(version)
        calls = [name for name, _ in client.log]
        assert calls == ["takes_whole_updates", "update_weights_from_buffers"] * 4
        bodies = client.bodies()
        assert ["payload" in b for body in bodies for b in body["buffers"]] == [
            True,
            False,
            False,
            False,
        ]
        first = bodies[0]
        assert (first["pause_mode"], first["flush_cache"]) == ("retract", True)
        assert (first["weight_version"], first["continue_generation"]) == ("1", True)
        assert not serving.is_paused
        sender.close()
        await client.close()

    asyncio.run(scenario())


def test_a_changed_layout_is_sent_again_never_misapplied(models: tuple[Path, Path]) -> None:
    trainer = _weights(models[1])
    names = list(trainer)

    async def scenario() -> None:
        serving = await _engine(models[0])
        client = Logged(InProcessEngineClient(serving, owns_serving=True))
        sender = IpcBucketSender(bucket_bytes=ALL_IN_TWO)
        sync = WeightSync([client], sender)
        await sync.push(lambda: trainer.items(), 1)
        # Other tensors in the same buffer (half the names, in another order): a new layout.
        half = {n: trainer[n] + 1 for n in reversed(names[: len(names) // 2])}
        await sync.push(lambda: half.items(), 2)
        # The same tensors in the same buffer again: the layout is reused, the bytes are new.
        half = {n: t + 1 for n, t in half.items()}
        await sync.push(lambda: half.items(), 3)
        layouts = [b["buffers"][0] for b in client.bodies()]
        assert ["payload" in b for b in layouts] == [True, True, False]
        assert layouts[0]["layout"] != layouts[1]["layout"] == layouts[2]["layout"]
        expected = {**trainer, **half}
        assert _holds(serving, expected) and serving.weight_version == "3"
        # A buffer that grows is another buffer: a new layout, and the old ones are let go.
        wide = {**trainer, "extra": torch.zeros(1 << 16)}
        with pytest.raises(SharedTensorError, match="unknown parameter name 'extra'"):
            await sync.push(lambda: wide.items(), 4)
        assert _holds(serving, expected) and serving.weight_version == "3"
        assert not serving.is_paused  # refused before the pause: nothing changed
        await sync.push(lambda: trainer.items(), 4)
        refused, last = client.bodies()[-2:]
        old = {layouts[0]["layout"], layouts[1]["layout"]}
        assert set(refused["release_layouts"]) == old and "release_layouts" not in last
        assert "payload" in last["buffers"][0] and last["buffers"][0]["layout"] not in old
        assert len(serving._layouts) == 1
        assert _holds(serving, trainer) and serving.weight_version == "4"
        sender.close()
        await client.close()

    asyncio.run(scenario())


def test_an_engine_that_forgot_the_layout_gets_it_again(models: tuple[Path, Path]) -> None:
    """As after an engine restart: it answers 409 before changing anything, then takes the
    payloads."""
    trainer = _weights(models[1])

    async def scenario() -> None:
        serving = await _engine(models[0])
        client = Logged(InProcessEngineClient(serving, owns_serving=True))
        sender = IpcBucketSender(bucket_bytes=ALL_IN_TWO)
        sync = WeightSync([client], sender)
        await sync.push(lambda: trainer.items(), 1)
        serving._layouts = None  # the engine lets every layout go
        doubled = {n: t * 2 for n, t in trainer.items()}
        report = await sync.push(lambda: doubled.items(), 2)
        assert report.calls == ["update"]
        assert ["payload" in b["buffers"][0] for b in client.bodies()] == [True, False, True]
        assert _holds(serving, doubled) and serving.weight_version == "2"
        sender.close()
        await client.close()

    asyncio.run(scenario())


def test_more_buckets_than_buffers_a_request_each(models: tuple[Path, Path]) -> None:
    trainer = _weights(models[1])

    async def scenario() -> None:
        serving = await _engine(models[0])
        client = Logged(InProcessEngineClient(serving, owns_serving=True))
        sender = IpcBucketSender(bucket_bytes=16 << 10)
        sync = WeightSync([client], sender, pause_mode="abort")
        for version in (1, 2, 3):
            weights = {n: t - version for n, t in trainer.items()}
            client.log.clear()
            await sync.push(lambda w=weights: w.items(), version)
            bodies = client.bodies()
            assert len(bodies) == len(sender.buckets_sent) > sender.num_buffers
            assert bodies[0]["pause_mode"] == "abort" and "weight_version" not in bodies[0]
            assert all("pause_mode" not in b and "weight_version" not in b for b in bodies[1:-1])
            assert bodies[-1]["weight_version"] == str(version)
            assert _holds(serving, weights) and not serving.is_paused
            # The buffers grow during the first push (to the largest bucket they hold), so the
            # second still opens a few; from then on no layout is sent again.
            payloads = ["payload" in b["buffers"][0] for b in bodies]
            assert all(payloads) if version == 1 else not any(payloads) or version == 2
        sender.close()
        await client.close()

    asyncio.run(scenario())


GREEDY = {"sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}


async def versions_per_token_hold(models: tuple[Path, Path], device: str = "cpu") -> None:
    """Greedy requests run while one-request updates flip the weights between two models
    (retract): each token is stamped with the version that made it (versions never go back in
    a request), and every run of tokens of one version is what that version's model continues
    the prefix with (the KV is recomputed). Shared by the CUDA test."""
    weights = {
        v: {n: t.to(device) for n, t in _weights(m).items()}
        for v, m in ((1, models[1]), (2, models[0]))
    }
    serving = await _engine(models[0], device)
    client = InProcessEngineClient(serving, owns_serving=True)
    sender = IpcBucketSender(bucket_bytes=ALL_IN_TWO)
    sync = WeightSync([client], sender, pause_mode="retract")
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(4)]
    running = [asyncio.ensure_future(client.generate({"input_ids": p, **GREEDY})) for p in prompts]
    for version in range(1, 7):
        await asyncio.sleep(0.02)
        await sync.push(lambda v=version: weights[2 - v % 2].items(), version)
    results = await asyncio.gather(*running)
    references = {v: await _engine(m, device) for v, m in ((1, models[1]), (2, models[0]))}
    spanning = 0
    for prompt, result in zip(prompts, results, strict=True):
        spans = result["meta_info"]["weight_versions"]
        assert [int(s["version"]) for s in spans] == sorted(int(s["version"]) for s in spans)
        spanning += len(spans) > 1
        ids = result["output_ids"]
        for span in spans:  # version 0: the engine's start weights, model a's
            reference = InProcessEngineClient(references[2 - int(span["version"]) % 2])
            params = {**GREEDY["sampling_params"], "max_new_tokens": span["end"] - span["start"]}
            want = await reference.generate(
                {"input_ids": prompt + ids[: span["start"]], "sampling_params": params}
            )
            assert want["output_ids"] == ids[span["start"] : span["end"]], span
    assert spanning > 0  # some request ran across an update
    for reference_engine in references.values():
        await reference_engine.stop()
    sender.close()
    await client.close()


def test_requests_in_flight_see_one_version_per_token(models: tuple[Path, Path]) -> None:
    asyncio.run(versions_per_token_hold(models))


# ---- over HTTP: verst serve, and an SGLang server ---------------------------------------------


def test_an_unknown_layout_is_refused_before_anything_changes(models: tuple[Path, Path]) -> None:
    async def scenario() -> None:
        engine = await serve_engine(ServingEngine.from_model_dir(str(models[0]), seed=0))
        try:
            client = HttpEngineClient(engine.url)
            assert await client.takes_whole_updates()
            body = {
                "buffers": [{"layout": "no-such-layout"}],
                "pause_mode": "retract",
                "weight_version": "9",
                "continue_generation": True,
            }
            status, reply = await call(engine.url, BUFFERS_PATH, body)
            assert status == 409 and reply["unknown_layouts"] == ["no-such-layout"], reply
            assert await client.get_weight_version() == "0" and not engine.serving.is_paused
            status, reply = await call(engine.url, BUFFERS_PATH, {"buffers": [{"layout": 3}]})
            assert status == 400, reply
            await client.close()
        finally:
            await engine.runner.cleanup()

    asyncio.run(scenario())


class FakeSglang:
    """The routes of an SGLang server that weight sync uses; it records each request."""

    def __init__(self) -> None:
        self.log: list[tuple[str, dict[str, Any]]] = []
        self.version = "0"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for path in (
            "/pause_generation",
            "/flush_cache",
            "/update_weights_from_tensor",
            "/update_weight_version",
            "/continue_generation",
        ):
            app.router.add_post(path, self.answer)
        app.router.add_get("/server_info", self.answer)
        app.router.add_get("/model_info", self.answer)
        return app

    async def answer(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.log.append((request.path, body))
        if request.path == "/update_weight_version":
            self.version = body["new_version"]
        if request.path == "/flush_cache":
            return web.Response(text="Cache flushed.")
        return web.json_response(
            {"success": True, "version": "0.5.9", "weight_version": self.version}
        )


def test_an_sglang_server_gets_sglangs_calls(models: tuple[Path, Path]) -> None:
    trainer = _weights(models[1])
    fake = FakeSglang()

    async def scenario() -> None:
        runner, url = await start_app(fake.app())
        try:
            client = HttpEngineClient(url)
            sender = IpcBucketSender(bucket_bytes=ALL_IN_TWO)
            report = await WeightSync([client], sender).push(lambda: trainer.items(), 1)
            assert report.calls == ["pause", "flush", "send", "set_version", "continue"]
            sender.close()
            await client.close()
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    paths = [path for path, _ in fake.log]
    assert paths == [
        "/server_info",
        "/pause_generation",
        "/flush_cache",
        "/update_weights_from_tensor",
        "/update_weight_version",
        "/continue_generation",
        "/model_info",
    ]
    (update,) = [body for path, body in fake.log if path == "/update_weights_from_tensor"]
    assert set(update) == {"serialized_named_tensors", "load_format", "flush_cache"}
    assert update["load_format"] == "flattened_bucket"


class Unreachable:
    """An engine process that takes whole updates and then stops answering (or died)."""

    def __init__(self, *, alive: bool) -> None:
        self.alive = alive

    async def takes_whole_updates(self) -> bool:
        return True

    async def update_weights_from_buffers(self, body: dict[str, Any]) -> dict[str, Any]:
        raise ConnectionResetError("the engine went away")

    async def health(self) -> bool:
        return self.alive


def test_an_engine_that_fails_the_update_is_lost_when_dead(models: tuple[Path, Path]) -> None:
    trainer = _weights(models[1])

    async def scenario() -> None:
        serving = await _engine(models[0])
        good = InProcessEngineClient(serving, owns_serving=True)
        dead, hung = Unreachable(alive=False), Unreachable(alive=True)
        lost: list[Any] = []
        sender = IpcBucketSender(bucket_bytes=ALL_IN_TWO)
        sync = WeightSync(
            [good, dead], sender, on_engine_lost=lambda engine, reason: lost.append(engine)
        )
        report = await sync.push(lambda: trainer.items(), 1)
        assert report.calls == ["update"] and report.lost == [dead] and lost == [dead]
        assert _holds(serving, trainer) and serving.weight_version == "1"
        # alive but failing: the push fails rather than dropping an engine that answers
        sync = WeightSync([good, hung], sender, on_engine_lost=lambda *_: None)
        with pytest.raises(WeightSyncError, match="alive but failed the update"):
            await sync.push(lambda: trainer.items(), 2)
        with pytest.raises(ConnectionResetError):  # without a callback: the failure itself
            await WeightSync([good, hung], sender).push(lambda: trainer.items(), 3)
        sender.close()
        await good.close()

    asyncio.run(scenario())
