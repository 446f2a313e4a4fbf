"""The SGLang-compatible aiohttp app over a `ServingEngine` (`make_app`) and `verst serve`
(`run_server`).

The app only moves JSON in and out: parsing, validation and the response bodies live in
`verst.engine.server.sglang_api` (shared with the in-process client), and the app answers its
`ProtocolError` with the status and envelope it carries. aiohttp is imported only inside these
functions, so importing this module does not need the `serve` extra.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from verst.engine.sampling import SamplingParams
from verst.engine.server.openai_api import openai_stream_chunks, run_openai
from verst.engine.server.sglang_api import (
    CONTINUE_OK,
    FLUSH_CACHE_TEXT,
    ProtocolError,
    loads_body,
    model_info_body,
    parse_generate,
    run_abort,
    run_destroy_weights_update_group,
    run_get_weights_by_name,
    run_init_weights_update_group,
    run_job,
    run_pause,
    run_update_weight_version,
    run_update_weights_from_disk,
    run_update_weights_from_distributed,
    run_update_weights_from_tensor,
    server_info_body,
    validation_error,
)
from verst.engine.serving import ServingEngine

if TYPE_CHECKING:
    from aiohttp import web

HEALTH_TIMEOUT_S = 20.0


def sse(event: Any) -> bytes:
    return f"data: {json.dumps(event) if not isinstance(event, str) else event}\n\n".encode()


def make_app(
    serving: ServingEngine,
    tokenizer: Any,
    *,
    served_model_name: str,
    host: str = "",
    port: int = 0,
    health_timeout_s: float = HEALTH_TIMEOUT_S,
) -> web.Application:
    """The SGLang-compatible app; starts and stops `serving` with the app."""
    try:
        from aiohttp import web
    except ImportError as error:
        raise ImportError(
            "the verst HTTP server needs aiohttp: pip install 'verst[serve]'"
        ) from error

    def json_response(body: Any, status: int = 200) -> web.Response:
        return web.json_response(body, status=status)

    async def read_json(request: web.Request, *, optional: bool = False) -> Any:
        raw = await request.read()
        if not raw.strip():
            if optional:
                return None
            raise validation_error("the request body is empty; expected a JSON object")
        try:
            return json.loads(raw)
        except ValueError as error:
            raise validation_error(f"JSON decode error: {error}") from error

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProtocolError as error:
            return json_response(error.body, error.status)
        except web.HTTPException:
            raise
        except Exception as error:  # an engine failure: SGLang's native error envelope
            return json_response({"error": {"message": f"{type(error).__name__}: {error}"}}, 500)

    async def stream(request: web.Request, events: list[Any]) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for event in events:
            await response.write(sse(event))
        await response.write(sse("[DONE]"))
        await response.write_eof()
        return response

    async def generate(request: web.Request) -> web.StreamResponse:
        payload = await read_json(request)
        job = parse_generate(payload, tokenizer, serving.context_len)
        results = await run_job(serving, job)
        if isinstance(payload, dict) and payload.get("stream"):
            # Cumulative chunks (S14+ default); the engine finishes a batch at once, so each
            # item has one chunk, tagged with its index when the request is a list.
            if job.is_list:
                results = [{**r, "index": i} for i, r in enumerate(results)]
            return await stream(request, results)
        return json_response(results if job.is_list else results[0])

    async def openai(request: web.Request, chat: bool) -> web.StreamResponse:
        payload = await read_json(request)
        body = await run_openai(serving, tokenizer, payload, served_model_name, chat=chat)
        if payload.get("stream"):
            include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
            return await stream(request, openai_stream_chunks(body, chat=chat, usage=include_usage))
        return json_response(body)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await openai(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await openai(request, chat=True)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if serving.is_alive else 503)

    async def health_generate(request: web.Request) -> web.Response:
        probe = serving.generate(
            [0],
            SamplingParams(max_new_tokens=1, temperature=0.0),
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            return_logprob=False,
        )
        try:
            await asyncio.wait_for(probe, timeout=health_timeout_s)
        except (asyncio.TimeoutError, RuntimeError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def ready(request: web.Request) -> web.Response:
        return web.Response(status=503 if serving.is_paused or not serving.is_alive else 200)

    async def model_info(request: web.Request) -> web.Response:
        return json_response(model_info_body(serving, served_model_name))

    async def server_info(request: web.Request) -> web.Response:
        return json_response(server_info_body(serving, served_model_name, host, port))

    async def loads(request: web.Request) -> web.Response:
        return json_response(loads_body(serving))

    async def models(request: web.Request) -> web.Response:
        model = {
            "id": served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "verst",
            "root": serving.model_path,
            "max_model_len": serving.context_len,
        }
        return json_response({"object": "list", "data": [model]})

    async def flush_cache(request: web.Request) -> web.Response:
        ok = await serving.flush_cache()
        return web.Response(text=FLUSH_CACHE_TEXT, status=200 if ok else 400)

    async def abort_request(request: web.Request) -> web.Response:
        await run_abort(serving, await read_json(request, optional=True))
        return web.Response(status=200)

    async def pause_generation(request: web.Request) -> web.Response:
        return json_response(await run_pause(serving, await read_json(request, optional=True)))

    async def continue_generation(request: web.Request) -> web.Response:
        await read_json(request, optional=True)
        await serving.resume()
        return json_response(CONTINUE_OK)

    async def update_weights_from_disk(request: web.Request) -> web.Response:
        status, body = await run_update_weights_from_disk(serving, await read_json(request))
        return json_response(body, status)

    def weights_route(run):  # type: ignore[no-untyped-def]
        async def handle(request: web.Request) -> web.Response:
            status, body = await run(serving, await read_json(request))
            return json_response(body, status)

        return handle

    async def get_weight_version(request: web.Request) -> web.Response:
        return json_response({"weight_version": serving.weight_version})

    async def update_weight_version(request: web.Request) -> web.Response:
        return json_response(await run_update_weight_version(serving, await read_json(request)))

    app = web.Application(middlewares=[errors], client_max_size=1 << 30)
    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/ready", ready)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_get("/v1/loads", loads)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/init_weights_update_group", weights_route(run_init_weights_update_group))
    app.router.add_post(
        "/destroy_weights_update_group", weights_route(run_destroy_weights_update_group)
    )
    app.router.add_post(
        "/update_weights_from_distributed", weights_route(run_update_weights_from_distributed)
    )
    app.router.add_post(
        "/update_weights_from_tensor", weights_route(run_update_weights_from_tensor)
    )
    for method in ("GET", "POST"):
        app.router.add_route(method, "/get_weights_by_name", weights_route(run_get_weights_by_name))
    app.router.add_get("/get_weight_version", get_weight_version)
    app.router.add_post("/update_weight_version", update_weight_version)

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        await serving.start()
        yield
        await serving.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


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
) -> None:
    """Load `model_path` and serve it until interrupted (SIGINT / SIGTERM), or, with
    `parent_pid`, until that process is gone (a training run that launched it and died)."""
    import torch
    from aiohttp import web

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
    )
    app = make_app(
        serving,
        serving.tokenizer,
        served_model_name=served_model_name or model_path,
        host=host,
        port=port,
    )
    if parent_pid is not None:
        app.cleanup_ctx.append(_exit_with_parent(parent_pid))
    print(f"verst serve: {model_path} on http://{host}:{port} ({device}, {dtype})", flush=True)
    web.run_app(app, host=host, port=port, print=None, access_log=None)


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
