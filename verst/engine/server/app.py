"""The SGLang-compatible aiohttp app over a `ServingEngine` (`make_app`) and `verst serve`
(`run_server`).

The app only moves JSON in and out: parsing, validation and the response bodies live in
`verst.engine.server.sglang_api` (shared with the in-process client), and the app answers a
`ProtocolError` (`protocol_errors`) with the status and envelope it carries. This module owns
the route table; the handlers live in `verst.engine.server.handlers`, imported with aiohttp
only when an app is built, so importing this module does not need the `serve` extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verst.auth import ApiKeys, auth_middleware, warn_if_open
from verst.engine.adapters import DEFAULT_MAX_ADAPTERS, read_adapter_dir
from verst.engine.config import Quantization
from verst.engine.serving import ServingEngine
from verst.http_limits import HttpLimits, limited_app
from verst.sync.broadcast import WHOLE_UPDATE_PATH
from verst.sync.buffer_layouts import BUFFERS_PATH

if TYPE_CHECKING:
    from aiohttp import web

    from verst.engine.server.handlers import EngineHandlers

HEALTH_TIMEOUT_S = 20.0
# A client that leaves these aborts its request; every other route runs to its end.
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
MAX_N = 1024  # upper bound on sampling_params.n (and OpenAI's n): n samples cost n requests

# Routes that steer the engine rather than ask it for tokens: with `--admin-api-key` set they
# need that key (SGLang's admin routes); `/abort_request` only with `abort_all`.
CONTROL_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        BUFFERS_PATH,
        WHOLE_UPDATE_PATH,
        "/update_weight_version",
        "/get_weights_by_name",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }
)


async def is_control_request(request: Any) -> bool:
    if request.path in CONTROL_PATHS:
        return True
    if request.path != "/abort_request":
        return False
    import json

    try:
        body = json.loads(await request.read() or b"{}")
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False  # the handler answers the malformed body
    return isinstance(body, dict) and bool(body.get("abort_all"))


def make_app(
    serving: ServingEngine,
    tokenizer: Any,
    *,
    served_model_name: str,
    host: str = "",
    port: int = 0,
    health_timeout_s: float = HEALTH_TIMEOUT_S,
    api_keys: ApiKeys | None = None,
    limits: HttpLimits | None = None,
    max_n: int = MAX_N,
    tool_call_parser: str | None = None,
) -> web.Application:
    """The SGLang-compatible app; starts and stops `serving` with the app. With `api_keys`,
    every route but `/health...` needs the key (control routes the admin key, when set). Serve
    it with `verst.http_limits.runner_kwargs` so a client that disconnects aborts its request.
    `tool_call_parser` names the format of chat tool calls (None: the chat template's family's)."""
    try:
        import aiohttp  # noqa: F401  (the import error names the extra)
    except ImportError as error:
        raise ImportError(
            "the verst HTTP server needs aiohttp: pip install 'verst[serve]'"
        ) from error
    from verst.engine.server.handlers import EngineHandlers, protocol_error_middleware
    from verst.engine.server.metrics_api import metrics_handler

    h = EngineHandlers(
        serving,
        tokenizer,
        served_model_name=served_model_name,
        host=host,
        port=port,
        health_timeout_s=health_timeout_s,
        max_n=max_n,
        tool_call_parser=tool_call_parser,
    )
    middlewares: list[Any] = [protocol_error_middleware]
    if api_keys is not None and api_keys.enabled:
        middlewares.insert(0, auth_middleware(api_keys, is_control_request))
    limits = limits or HttpLimits()
    app = limited_app(limits, *middlewares, cancellable=GENERATION_PATHS.__contains__)
    _add_routes(app.router, h)
    app.router.add_get("/metrics", metrics_handler(serving, served_model_name))
    app.cleanup_ctx.append(h.lifecycle)
    return app


def _add_routes(routes: Any, h: EngineHandlers) -> None:
    """SGLang's routes (and verst's own) onto `h`'s handlers."""
    routes.add_route("POST", "/generate", h.generate)
    routes.add_route("PUT", "/generate", h.generate)
    routes.add_post("/v1/completions", h.completions)
    routes.add_post("/v1/chat/completions", h.chat_completions)
    routes.add_get("/v1/models", h.models)
    routes.add_get("/v1/models/{model:.+}", h.model)  # the served name may be a path
    for path in ("/tokenize", "/v1/tokenize"):
        routes.add_post(path, h.tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        routes.add_post(path, h.detokenize)
    routes.add_get("/health", h.health)
    routes.add_get("/health_generate", h.health_generate)
    routes.add_get("/ready", h.ready)
    for path in ("/model_info", "/get_model_info"):
        routes.add_get(path, h.model_info)
    for path in ("/server_info", "/get_server_info"):
        routes.add_get(path, h.server_info)
    routes.add_get("/v1/loads", h.loads)
    routes.add_route("GET", "/flush_cache", h.flush_cache)
    routes.add_route("POST", "/flush_cache", h.flush_cache)
    routes.add_post("/abort_request", h.abort_request)
    routes.add_post("/pause_generation", h.pause_generation)
    routes.add_post("/continue_generation", h.continue_generation)
    routes.add_post("/update_weights_from_disk", h.update_weights_from_disk)
    routes.add_post("/init_weights_update_group", h.init_weights_update_group)
    routes.add_post("/destroy_weights_update_group", h.destroy_weights_update_group)
    routes.add_post("/update_weights_from_distributed", h.update_weights_from_distributed)
    routes.add_post("/update_weights_from_tensor", h.update_weights_from_tensor)
    routes.add_post(BUFFERS_PATH, h.update_weights_from_buffers)  # verst's own
    routes.add_post(WHOLE_UPDATE_PATH, h.update_weights_whole_from_distributed)  # verst's own
    for method in ("GET", "POST"):
        routes.add_route(method, "/get_weights_by_name", h.get_weights_by_name)
    routes.add_post("/load_lora_adapter", h.load_lora_adapter)
    routes.add_post("/unload_lora_adapter", h.unload_lora_adapter)
    routes.add_get("/get_weight_version", h.get_weight_version)
    routes.add_post("/update_weight_version", h.update_weight_version)


def run_server(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    served_model_name: str | None = None,
    max_batch_size: int = 256,
    parent_pid: int | None = None,
    limits: HttpLimits | None = None,
    max_n: int = MAX_N,
    api_keys: ApiKeys | None = None,
    allowed_weight_dirs: Sequence[str] = (),
    group_join_timeout_s: float = 30.0,
    max_loras: int = DEFAULT_MAX_ADAPTERS,
    lora_paths: dict[str, str] | None = None,
    tool_call_parser: str | None = None,
    true_on_policy: bool = False,
    quantization: Quantization = "none",
    overlap: bool | None = None,
) -> None:
    """Load `model_path` and serve it until interrupted (SIGINT / SIGTERM), or, with
    `parent_pid`, until that process is gone (a training run that launched it and died)."""
    import torch

    from verst.http_limits import run_app

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    serving = ServingEngine.from_model_dir(
        model_path,
        seed=seed,
        device=device,
        dtype=getattr(torch, dtype),
        max_batch_size=max_batch_size,
        max_adapters=max_loras,
        true_on_policy=true_on_policy,
        quantization=quantization,
        overlap=overlap,
    )
    for name, path in (lora_paths or {}).items():  # the operator's own: no directory limit
        config, tensors = read_adapter_dir(Path(path))
        serving.scheduler.load_adapter(name, config, tensors, path)
    # Weights from disk only under the model's parent (a trainer's run directory) and these.
    roots = [Path(model_path).expanduser().resolve().parent, *map(Path, allowed_weight_dirs)]
    serving.allowed_weight_dirs = tuple(roots)
    serving.group_join_timeout_s = group_join_timeout_s
    app = make_app(
        serving,
        serving.tokenizer,
        served_model_name=served_model_name or model_path,
        host=host,
        port=port,
        limits=limits,
        max_n=max_n,
        api_keys=api_keys,
        tool_call_parser=tool_call_parser,
    )
    warn_if_open("verst serve", host, api_keys or ApiKeys())
    if parent_pid is not None:
        app.cleanup_ctx.append(_exit_with_parent(parent_pid))
    print(f"verst serve: {model_path} on http://{host}:{port} ({device}, {dtype})", flush=True)
    run_app(app, host=host, port=port, limits=limits or HttpLimits())


def _exit_with_parent(parent_pid: int, poll_s: float = 1.0):  # type: ignore[no-untyped-def]
    """An aiohttp cleanup context that stops the server once `parent_pid` is no longer its
    parent (the parent died and the process was adopted)."""
    import asyncio
    import os
    import signal

    async def watch() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(poll_s)
        print(f"verst serve: parent process {parent_pid} is gone; stopping", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # run_app's own graceful shutdown

    async def context(app):  # type: ignore[no-untyped-def]
        task = asyncio.create_task(watch(), name="verst-parent-watch")
        yield
        task.cancel()

    return context
