"""A headless Chromium driven over the Chrome DevTools protocol (aiohttp's websocket client), for
tests of web pages: navigate, evaluate JavaScript, collect console errors, take a screenshot."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class Browser:
    """One headless Chromium with one page; `async with Browser() as page: ...`."""

    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        self.size = (width, height)
        self.errors: list[str] = []  # console errors, uncaught exceptions, failed loads
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}

    async def __aenter__(self) -> Browser:
        assert CHROMIUM, "no chromium on PATH"
        self._profile = Path(tempfile.mkdtemp(prefix="verst-chromium-"))
        width, height = self.size
        self._process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", f"--window-size={width},{height}",
             "--remote-debugging-port=0", f"--user-data-dir={self._profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # its helper processes share its group: killed with it
        )  # fmt: skip
        browser_url = await asyncio.to_thread(self._devtools_url)
        http = browser_url.split("/devtools/")[0].replace("ws://", "http://")
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"{http}/json/list") as answer:
            pages = [t for t in await answer.json() if t["type"] == "page"]
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        for domain in ("Runtime", "Log", "Page"):
            await self.send(f"{domain}.enable")
        return self

    def _devtools_url(self) -> str:
        deadline = time.monotonic() + 60
        assert self._process.stderr is not None
        while time.monotonic() < deadline:
            line = self._process.stderr.readline()
            if match := _LISTENING.search(line):
                return match.group(1)
            if not line and self._process.poll() is not None:
                break
        raise RuntimeError("chromium did not open its DevTools port")

    async def __aexit__(self, *exc: object) -> None:
        self._reader.cancel()
        await self._ws.close()
        await self._session.close()
        os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait()
        for attempt in range(20):  # a helper may still be dying with a file open in the profile
            try:
                shutil.rmtree(self._profile)
                break
            except OSError:
                if attempt == 19:
                    raise
                time.sleep(0.1)

    async def _read(self) -> None:
        async for message in self._ws:
            event = json.loads(message.data)
            if "id" in event and event["id"] in self._waiting:
                self._waiting.pop(event["id"]).set_result(event)
            else:
                self._note(event)

    def _note(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a)) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            self.errors.append(str(params["exceptionDetails"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(params["entry"]["text"])

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self._ids)
        self._waiting[message_id] = asyncio.get_running_loop().create_future()
        await self._ws.send_str(json.dumps({"id": message_id, "method": method, "params": params}))
        answer = await asyncio.wait_for(self._waiting[message_id], 60)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer["result"]

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 60) -> Any:
        """The value of `expression` once it is truthy; fails after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"still false after {timeout_s} s: {expression}")
            await asyncio.sleep(0.2)

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
