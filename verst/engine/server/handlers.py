"""The engine server's HTTP handlers: `EngineHandlers`, one method per SGLang / OpenAI route over
a `ServingEngine`, and the `protocol_error_middleware` that answers a `ProtocolError` with the
status and envelope it carries.

`verst.engine.server.app.make_app` builds one `EngineHandlers` per app and registers its
methods. This module imports aiohttp at the top: only the app factory imports it, so
`verst.engine.server.app` itself stays importable without the `serve` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from verst.engine.server.control_api import (
    CONTINUE_OK,
    FLUSH_CACHE_TEXT,
    loads_body,
    model_info_body,
    probe_generation,
    run_abort,
    run_destroy_weights_update_group,
    run_get_weights_by_name,
    run_init_weights_update_group,
    run_load_lora_adapter,
    run_pause,
    run_unload_lora_adapter,
    run_update_weight_version,
    run_update_weights_from_buffers,
    run_update_weights_from_disk,
    run_update_weights_from_distributed,
    run_update_weights_from_tensor,
    run_update_weights_whole_from_distributed,
    server_info_body,
)
from verst.engine.server.openai_api import prepare_openai, run_openai
from verst.engine.server.openai_stream import openai_chunks
from verst.engine.server.protocol_errors import ProtocolError, validation_error, value_error
from verst.engine.server.sglang_api import check_job, parse_generate, run_job
from verst.engine.server.stream_api import error_event, generate_chunks
from verst.engine.server.tokenize_api import detokenize_body, tokenize_body
from verst.engine.serving import ServingEngine

# A weights route's protocol call: (serving, JSON body) → (status, response body).
WeightsCall = Callable[[ServingEngine, Any], Awaitable[tuple[int, Any]]]


def sse(event: Any) -> bytes:
    return f"data: {json.dumps(event) if not isinstance(event, str) else event}\n\n".encode()


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


async def read_json(request: web.Request, *, optional: bool = False) -> Any:
    """The request's JSON body; an empty body is None when `optional`, else a 400. A body that
    cannot be decoded (a bad Content-Encoding, nesting past the parser's depth, a lone
    surrogate that no tokenizer or UTF-8 writer accepts) is a 400 too."""
    try:
        raw = await request.read()
    except (RequestPayloadError, HttpProcessingError, zlib.error) as error:
        raise validation_error(f"the request body cannot be decoded: {error}") from error
    if not raw.strip():
        if optional:
            return None
        raise validation_error("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except RecursionError as error:
        raise validation_error("JSON decode error: nested too deeply") from error
    except ValueError as error:
        raise validation_error(f"JSON decode error: {error}") from error
    if LONE_SURROGATE.search(raw) and _has_lone_surrogate(body):
        raise validation_error("JSON decode error: a string holds a lone UTF-16 surrogate")
    return body


# `\ud800`-`\udfff` escapes: only a body holding one can decode to a lone surrogate.
LONE_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def stream(request: web.Request, events: AsyncIterator[Any]) -> web.StreamResponse:
    """`events` as server-sent events as they come, closed by `[DONE]`. A failure once the
    stream has started is an error event (the status is sent already); a client that leaves
    cancels the handler, and closing `events` aborts its requests."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                await response.write(sse(event))
        except ConnectionError:
            raise  # the client is gone: nothing more can reach it
        except Exception as error:
            await response.write(sse(error_event(error)))
    await response.write(sse("[DONE]"))
    await response.write_eof()
    return response


def check_n(payload: Any, max_n: int) -> None:
    """A 400 for `n` (SGLang's `sampling_params.n`, OpenAI's `n`) above `max_n`, checked before
    parsing builds one item per sample."""
    if not isinstance(payload, dict):
        return
    raw = payload.get("sampling_params")
    candidates = [payload.get("n")] + [
        p.get("n") for p in (raw if isinstance(raw, list) else [raw]) if isinstance(p, dict)
    ]
    for n in candidates:
        if isinstance(n, (int, float)) and not isinstance(n, bool) and n > max_n:
            raise value_error(f"n must be <= {max_n} (the server's --max-n), got {n}")


@web.middleware
async def protocol_error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProtocolError as error:
        return json_response(error.body, error.status)
    except web.HTTPException:
        raise
    except Exception as error:  # an engine failure: SGLang's native error envelope
        return json_response({"error": {"message": f"{type(error).__name__}: {error}"}}, 500)


class EngineHandlers:
    """The routes of the engine app over one `ServingEngine`; `lifecycle` starts and stops it."""

    def __init__(
        self,
        serving: ServingEngine,
        tokenizer: Any,
        *,
        served_model_name: str,
        host: str,
        port: int,
        health_timeout_s: float,
        max_n: int,
        tool_call_parser: str | None = None,
    ) -> None:
        self.serving = serving
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.host = host
        self.port = port
        self.health_timeout_s = health_timeout_s
        self.max_n = max_n
        self.tool_call_parser = tool_call_parser

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        await self.serving.start()
        yield
        await self.serving.stop()

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        payload = await read_json(request)
        check_n(payload, self.max_n)
        if isinstance(payload, dict) and payload.get("text") is not None:
            # Tokenizing a long prompt takes seconds: never on the event loop.
            job = await asyncio.to_thread(
                parse_generate, payload, self.tokenizer, self.serving.context_len
            )
        else:
            job = parse_generate(payload, self.tokenizer, self.serving.context_len)
        if payload.get("stream"):
            check_job(self.serving, job)  # a bad job is a 400 before the stream starts
            return await stream(request, generate_chunks(self.serving, job))
        results = await run_job(self.serving, job)
        return json_response(results if job.is_list else results[0])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        payload = await read_json(request)
        check_n(payload, self.max_n)
        if isinstance(payload, dict) and payload.get("stream"):
            job, tools = await prepare_openai(self.serving, self.tokenizer, payload, chat=chat)
            chunks = openai_chunks(
                self.serving,
                self.tokenizer,
                job,
                payload,
                self.served_model_name,
                chat=chat,
                tools=tools,
                tool_format=self.tool_call_parser,
            )
            return await stream(request, chunks)
        body = await run_openai(
            self.serving,
            self.tokenizer,
            payload,
            self.served_model_name,
            chat=chat,
            tool_format=self.tool_call_parser,
        )
        return json_response(body)

    # ---- health and info -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.serving.is_alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        ok = await probe_generation(self.serving, self.health_timeout_s)
        return web.Response(status=200 if ok else 503)

    async def ready(self, request: web.Request) -> web.Response:
        serving = self.serving
        return web.Response(status=503 if serving.is_paused or not serving.is_alive else 200)

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(model_info_body(self.serving, self.served_model_name))

    async def server_info(self, request: web.Request) -> web.Response:
        body = server_info_body(self.serving, self.served_model_name, self.host, self.port)
        return json_response(body)

    async def loads(self, request: web.Request) -> web.Response:
        return json_response(loads_body(self.serving))

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "verst",
            "root": self.serving.model_path,
            "max_model_len": self.serving.context_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{id}`: the served model's card, or SGLang's 404."""
        name = request.match_info["model"]
        if name != self.served_model_name:
            error = {
                "message": f"The model '{name}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return json_response({"error": error}, 404)
        return json_response(self._model_card())

    async def tokenize(self, request: web.Request) -> web.Response:
        payload = await read_json(request)
        # Tokenizing a long prompt takes seconds: never on the event loop.
        body = await asyncio.to_thread(
            tokenize_body, self.tokenizer, payload, self.serving.context_len
        )
        return json_response(body)

    async def detokenize(self, request: web.Request) -> web.Response:
        payload = await read_json(request)
        body = await asyncio.to_thread(
            detokenize_body, self.tokenizer, payload, self.serving.vocab_size
        )
        return json_response(body)

    # ---- control ---------------------------------------------------------------------------

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await self.serving.flush_cache()
        return web.Response(text=FLUSH_CACHE_TEXT, status=200 if ok else 400)

    async def abort_request(self, request: web.Request) -> web.Response:
        await run_abort(self.serving, await read_json(request, optional=True))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await run_pause(self.serving, await read_json(request, optional=True))
        return json_response(body)

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json(request, optional=True)
        await self.serving.resume()
        return json_response(CONTINUE_OK)

    # ---- weights ---------------------------------------------------------------------------

    async def _weights(self, run: WeightsCall, request: web.Request) -> web.Response:
        status, body = await run(self.serving, await read_json(request))
        return json_response(body, status)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        return await self._weights(run_update_weights_from_disk, request)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        return await self._weights(run_init_weights_update_group, request)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        return await self._weights(run_destroy_weights_update_group, request)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return await self._weights(run_update_weights_from_distributed, request)

    async def update_weights_whole_from_distributed(self, request: web.Request) -> web.Response:
        return await self._weights(run_update_weights_whole_from_distributed, request)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        return await self._weights(run_update_weights_from_tensor, request)

    async def update_weights_from_buffers(self, request: web.Request) -> web.Response:
        return await self._weights(run_update_weights_from_buffers, request)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._weights(run_load_lora_adapter, request)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._weights(run_unload_lora_adapter, request)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        return await self._weights(run_get_weights_by_name, request)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.serving.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await run_update_weight_version(self.serving, await read_json(request))
        return json_response(body)
