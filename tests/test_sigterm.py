"""SIGTERM stops `verst serve`, `verst route` and `verst sessions` within a few seconds, idle
or with requests and streams in flight (real subprocesses on loopback)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
pytestmark = pytest.mark.slow  # real subprocesses: about 35 s on two cores

from aiohttp import web  # noqa: E402

from tests.servers import LoopThread, start_app, tiny_config, tiny_model  # noqa: E402

STOP_WITHIN_S = 5.0
START_WITHIN_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(port: int, path: str) -> int | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            return int(sock.recv(64).split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _start(args: list[str], port: int, ready: str = "/health") -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "verst", *args, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + START_WITHIN_S
    while _get(port, ready) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.communicate()[1].decode()[-3000:])
        time.sleep(0.2)
    return proc


def _post(port: int, path: str, body: dict) -> socket.socket:
    """A request left in flight: the socket stays open, its answer unread."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _stops_quickly(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running {STOP_WITHIN_S} s after SIGTERM") from None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"), config=tiny_config(4096))


@pytest.fixture(scope="module")
def stuck_engine() -> Iterator[str]:
    """A fake engine whose /generate never answers and whose streams never end."""

    async def never(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            while True:
                await response.write(b'data: {"text": ""}\n\n')
                await asyncio.sleep(0.1)
        await asyncio.sleep(3600)
        return web.Response()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/generate", never)
    app.router.add_get("/health", health)
    loop = LoopThread()
    runner, url = loop.run(start_app(app))
    yield url
    loop.run(runner.cleanup())
    loop.close()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_serve_stops_on_sigterm(model_dir: Path, busy: bool) -> None:
    port = _free_port()
    proc = _start(["serve", "--model", str(model_dir), "--device", "cpu"], port)
    sockets = []
    if busy:
        long = {"max_new_tokens": 4000, "ignore_eos": True}
        prompts = [[1, 2, i] for i in range(8)]
        sockets.append(_post(port, "/generate", {"input_ids": prompts, "sampling_params": long}))
        stream = {"input_ids": [1, 2], "sampling_params": long, "stream": True}
        sockets.append(_post(port, "/generate", stream))
        time.sleep(0.5)
    _stops_quickly(proc)
    for sock in sockets:
        sock.close()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_route_stops_on_sigterm(stuck_engine: str, busy: bool) -> None:
    port = _free_port()
    proc = _start(["route", "--engines", stuck_engine], port, ready="/list_workers")
    sockets = []
    if busy:
        sockets.append(_post(port, "/generate", {"text": "hi"}))
        stream = _post(port, "/generate", {"text": "hi", "stream": True})
        assert stream.recv(64).startswith(b"HTTP/1.1 200")  # the stream is open
        sockets.append(stream)
    _stops_quickly(proc)
    for sock in sockets:
        sock.close()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_sessions_stops_on_sigterm(stuck_engine: str, model_dir: Path, busy: bool) -> None:
    port = _free_port()
    proc = _start(["sessions", "--router", stuck_engine, "--model", str(model_dir)], port)
    sockets = []
    if busy:
        create = _post(port, "/sessions", {})
        sid = json.loads(create.recv(4096).split(b"\r\n\r\n", 1)[1])["session_id"]
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        sockets.append(_post(port, f"/sessions/{sid}/v1/chat/completions", chat))
        time.sleep(0.3)
    _stops_quickly(proc)
    for sock in sockets:
        sock.close()
