"""The weight routes of `verst serve-diffusion`: SGLang's update protocol for one diffusion engine.

`ServedEngine` is the server's state: the engine, a condition whose lock lets one batch or one
weight update run at a time, the pause flag, the one adapter's name and the weight-update
groups joined. The routes are SGLang's, with its bodies, so the LM's `HttpEngineClient` and
`WeightSync` drive them unchanged:

- `/pause_generation` (any of SGLang's modes: the batch in flight finishes, later ones wait; a
  diffusion batch keeps no cache, so there is nothing to retract or abort) and
  `/continue_generation`; `/update_weight_version` (`new_version`, an integer); `GET
  /model_info` and `GET /get_weight_version` (the version);
- `/update_weights_from_disk` (`model_path` holding `transformer/`) and `/load_lora_adapter`
  (a peft directory, the adapters injected into the served base on the first load);
- `/init_weights_update_group` and `/update_weights_from_distributed` (the broadcast transport,
  `verst.sync.broadcast`): a bucket of the model's parameters, or with `lora_name` and
  `lora_config` a whole adapter, received through the group and copied in between two batches.

Bad requests answer 400 naming the field.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from verst.diffusion import model as tiny
from verst.diffusion.engine import DiffusionEngine
from verst.engine.serving import PAUSE_MODES
from verst.engine.weight_updates import GROUP_JOIN_TIMEOUT_S, BoundedJoins
from verst.sync.broadcast import bucket_specs, create_group, receive_bucket

GROUP_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")


class ServedEngine:
    def __init__(self, engine: DiffusionEngine, model_path: str = "") -> None:
        self.engine = engine
        self.model_path = model_path
        self.cond = asyncio.Condition()  # its lock: one batch or one weight update at a time
        self.paused = False
        self.adapter: str | None = None  # the one adapter's name, once loaded
        self.groups: dict[str, Any] = {}
        self.joins = BoundedJoins()

    @asynccontextmanager
    async def batch(self) -> AsyncIterator[None]:
        """Held while a batch runs; waits while generation is paused."""
        async with self.cond:
            await self.cond.wait_for(lambda: not self.paused)
            yield

    def check_adapter(self, name: str) -> None:
        if self.adapter is not None and name != self.adapter:
            raise ValueError(f"lora_name: this engine holds one adapter, {self.adapter!r}")

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        async with self.cond:  # the batch in flight has finished
            self.paused = True

    async def resume(self) -> None:
        async with self.cond:
            self.paused = False
            self.cond.notify_all()

    async def set_version(self, version: Any, *, field: str) -> None:
        try:
            number = int(str(version))
        except ValueError:
            raise ValueError(
                f"{field}: a diffusion engine's versions are integers, got {version!r}"
            ) from None
        async with self.cond:
            self.engine.set_weight_version(number)

    async def join(self, body: dict[str, Any]) -> str:
        """Join the trainer's weight-update group (blocks until every member joined)."""
        missing = [k for k in GROUP_FIELDS if body.get(k) is None]
        if missing:
            raise ValueError(f"{missing[0]}: Field required")
        if self.joins.busy:
            raise ValueError("another weights update group join is in progress")
        name = str(body.get("group_name") or "weight_update_group")
        join = functools.partial(
            create_group,
            master_address=str(body["master_address"]),
            master_port=int(body["master_port"]),
            rank=int(body["rank_offset"]),
            world_size=int(body["world_size"]),
            backend=str(body.get("backend") or "gloo"),
            group_name=name,
            connect_timeout_s=GROUP_JOIN_TIMEOUT_S,
        )
        try:
            self.groups[name] = await self.joins.run(join, GROUP_JOIN_TIMEOUT_S)
        except TimeoutError:
            raise ValueError(
                f"group_name: no rendezvous for {name!r} within {GROUP_JOIN_TIMEOUT_S:g} s"
            ) from None
        except RuntimeError as error:
            raise ValueError(f"group_name: failed to join {name!r}: {error}") from None
        return name

    async def receive(self, body: dict[str, Any]) -> None:
        """One broadcast bucket into the model (or, with `lora_name`, the adapter)."""
        specs = bucket_specs(body)
        load_format = body.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format: {load_format!r} is not supported")
        name = str(body.get("group_name") or "weight_update_group")
        group = self.groups.get(name)
        if group is None:
            raise ValueError(f"group_name: no weights update group {name!r}: call init first")
        lora_name = body.get("lora_name")
        config = body.get("lora_config") if lora_name is not None else None
        if lora_name is not None:
            self.check_adapter(str(lora_name))
            if not isinstance(config, dict):
                raise ValueError("lora_config: an adapter's bucket needs peft's keys")
        device = next(self.engine.model.parameters()).device
        flattened = load_format == "flattened_bucket"

        def load() -> None:
            # received before any check of the names: the trainer's side is under way
            received = receive_bucket(group, specs, device, flattened=flattened)
            self.engine.receive(dict(received), config)

        async with self.cond:
            await asyncio.to_thread(load)
            if body.get("weight_version") is not None:
                self.engine.set_weight_version(int(body["weight_version"]))
        if lora_name is not None:
            self.adapter = str(lora_name)

    async def load_from_disk(self, body: dict[str, Any]) -> None:
        path = Path(str(body.get("model_path", ""))) / "transformer"
        if not path.is_dir():
            raise ValueError(f"model_path: {path} is not a transformer directory")
        weights = tiny.read_weights(path, field="model_path")
        async with self.cond:
            await asyncio.to_thread(self.engine.model.load_state_dict, weights)
            self.engine.set_weight_version(
                int(body.get("weight_version", self.engine.weight_version + 1))
            )

    async def load_lora_adapter(self, body: dict[str, Any]) -> None:
        name, path = str(body.get("lora_name", "")), Path(str(body.get("lora_path", "")))
        self.check_adapter(name)
        async with self.cond:
            version = int(body.get("weight_version", self.engine.weight_version + 1))
            await asyncio.to_thread(self.engine.load_adapter, path, version)
        self.adapter = name

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "is_generation": False,
            "weight_version": str(self.engine.weight_version),
        }


def add_weight_routes(app: Any, served: ServedEngine) -> None:
    """The routes above on the aiohttp `app`; a ValueError answers 400 with its message."""
    from aiohttp import web

    def route(call, answer=None):  # noqa: ANN001, ANN202 - aiohttp handlers
        async def handler(request: web.Request) -> web.Response:
            try:
                body = await request.json() if request.can_read_body else {}
                if not isinstance(body, dict):
                    raise ValueError("the request body must be a JSON object")
                await call(body)
            except (ValueError, TypeError) as error:
                return web.json_response(
                    {"error": {"message": str(error), "code": 400}}, status=400
                )
            return web.json_response(answer() if answer else {"success": True})

        return handler

    version = functools.partial(served.set_version, field="new_version")
    ok = {
        "/pause_generation": lambda b: served.pause(str(b.get("mode") or "abort")),
        "/continue_generation": lambda _: served.resume(),
        "/update_weight_version": lambda b: version(b.get("new_version")),
        "/init_weights_update_group": served.join,
        "/update_weights_from_distributed": served.receive,
    }
    for path, call in ok.items():
        app.router.add_post(path, route(call))
    versioned = lambda: {"success": True, "weight_version": served.engine.weight_version}  # noqa: E731
    app.router.add_post("/update_weights_from_disk", route(served.load_from_disk, versioned))
    app.router.add_post("/load_lora_adapter", route(served.load_lora_adapter, versioned))

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response(served.model_info())

    async def weight_version(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": served.engine.weight_version})

    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_weight_version", weight_version)
