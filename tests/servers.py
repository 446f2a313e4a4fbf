"""Helpers for tests that run tiny verst servers on 127.0.0.1: an event loop in a thread, tiny
model directories, starting an aiohttp app (or a `ServingEngine` behind `make_app`) on a free
loopback port, and one plain JSON HTTP call.

Imports aiohttp at module level: test files import this only after
`pytest.importorskip("aiohttp")`."""

from __future__ import annotations

import json
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from verst.engine.server.app import make_app
from verst.engine.serving import ServingEngine
from verst.fleet.loop_thread import LoopThread as FleetLoopThread
from verst.http_limits import HttpLimits, runner_kwargs
from verst.models.tiny import TinyModelConfig, create_tiny
from verst.router import ROUTING_KEY_HEADER

T = TypeVar("T")
STEP_TIMEOUT_S = 30.0


def tiny_config(max_position_embeddings: int = 128) -> TinyModelConfig:
    """The shape every loopback-server test uses (2 layers, width 32)."""
    return TinyModelConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=max_position_embeddings,
    )


TINY = tiny_config()


def tiny_model(
    root: Path, name: str = "tiny", *, seed: int = 0, config: TinyModelConfig = TINY
) -> Path:
    """Write a random tiny model to `root / name` and return that directory."""
    path = root / name
    create_tiny(path, config, seed=seed)
    return path


class LoopThread(FleetLoopThread):
    """verst's event loop in a daemon thread, with the tests' step timeout: servers and clients
    live on it, so blocking code in the test's own thread can drive them."""

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = STEP_TIMEOUT_S) -> T:
        return super().run(coro, timeout_s)


async def start_app(
    app: web.Application, limits: HttpLimits | None = None
) -> tuple[web.AppRunner, str]:
    """Serve `app` on a free port of 127.0.0.1 (the OS picks it) as the `verst` commands do
    (`runner_kwargs`: a client that disconnects cancels its handler): (runner, base URL)."""
    runner = web.AppRunner(app, **runner_kwargs(limits or HttpLimits()))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@dataclass
class Engine:
    serving: ServingEngine
    runner: web.AppRunner
    url: str


def new_serving(model_dir: Path) -> ServingEngine:
    return ServingEngine.from_model_dir(str(model_dir), seed=0, batch_wait_s=0.005)


async def serve_engine(serving: ServingEngine) -> Engine:
    """`make_app` over `serving` (model name "tiny") on a free loopback port."""
    runner, url = await start_app(make_app(serving, serving.tokenizer, served_model_name="tiny"))
    return Engine(serving, runner, url)


async def start_engine(model_dir: Path) -> Engine:
    return await serve_engine(new_serving(model_dir))


async def call(
    url: str, path: str, body: Any = None, *, key: str | None = None, method: str = "POST"
) -> tuple[int, Any]:
    """One JSON request (with the routing key header when `key` is given): (status, parsed JSON,
    or the raw text when it is not JSON)."""
    headers = {ROUTING_KEY_HEADER: key} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url + path, json=body, headers=headers) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text) if text else None
            except ValueError:
                return response.status, text
