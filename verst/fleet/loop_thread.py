"""An asyncio event loop on a daemon thread, for synchronous code that drives coroutines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop on a daemon thread; synchronous code submits coroutines to it."""

    def __init__(self, name: str = "verst-fleet") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self.submit(coro).result(timeout_s)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the loop's thread (for objects that belong to the loop)."""

        async def on_loop() -> T:
            return fn(*args)

        return self.run(on_loop())

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
