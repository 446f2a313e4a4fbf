"""Sandboxes kept ready ahead of episodes, none of them ever reused.

`SandboxPool(cfg)` opens `cfg.pool_size` sandboxes in the background; `async with
pool.episode() as box` hands out a ready one (or opens one when none is ready), closes it when
the episode ends, whatever happened, and opens a replacement. A pool belongs to the event loop
that first uses it; what it still holds is closed by `close()`, and at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from verst.envs.sandbox import make_sandbox
from verst.envs.sandbox.base import Sandbox, SandboxError
from verst.envs.sandbox.config import SandboxConfig

log = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


class SandboxPool:
    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self._ready: list[Sandbox] = []
        self._filling: set[asyncio.Task[None]] = set()
        self._closed = False
        self.opened: list[str] = []  # ids of the sandboxes opened over the pool's life
        _LIVE.add(self)

    def _refill(self) -> None:
        while not self._closed and len(self._ready) + len(self._filling) < self.cfg.pool_size:
            task = asyncio.get_running_loop().create_task(self._open_one())
            self._filling.add(task)
            task.add_done_callback(self._filling.discard)

    async def _open_one(self) -> None:
        try:
            box = await asyncio.to_thread(self._open)
        except SandboxError as error:  # reported to the episode that needs one, not here
            log.debug("pool could not open a sandbox: %s", error)
            return
        if self._closed:
            await asyncio.to_thread(box.close)
        else:
            self._ready.append(box)

    def _open(self) -> Sandbox:
        box = make_sandbox(self.cfg).open()
        self.opened.append(box.id)
        return box

    async def acquire(self) -> Sandbox:
        """An open, never-used sandbox; `SandboxError` when the provider cannot open one."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        box = self._ready.pop() if self._ready else await asyncio.to_thread(self._open)
        self._refill()
        return box

    async def release(self, box: Sandbox) -> None:
        """End the sandbox's episode: kill what is left and delete its work directory."""
        await asyncio.to_thread(box.close)

    @asynccontextmanager
    async def episode(self) -> AsyncIterator[Sandbox]:
        box = await self.acquire()
        try:
            yield box
        finally:
            await self.release(box)

    def close(self) -> None:
        """Close the sandboxes still waiting; the pool hands out no more."""
        self._closed = True  # sandboxes still opening close themselves when they are done
        while self._ready:
            self._ready.pop().close()


@atexit.register
def _close_pools() -> None:
    for pool in list(_LIVE):
        pool.close()
