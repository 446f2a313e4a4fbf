"""The session server's HTTP handlers: `SessionHandlers`, one method per route over a
`SessionStore`, the `UpstreamClient` that calls the engine or router behind it, and the
`session_errors` middleware that answers a `SessionError` with its status and envelope.

`verst.sessions.server.make_session_app` builds these per app and registers the routes. This
module imports aiohttp at the top: only the app factory imports it, so
`verst.sessions.server` itself stays importable without the `serve` extra.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from verst.http_limits import loads_json
from verst.router.policy import ROUTING_KEY_HEADER
from verst.sessions.assembly import AssemblyError
from verst.sessions.openai_chat import (
    ChatTurn,
    answer_message,
    chat_chunk,
    chat_completion,
    chat_logprobs,
    sample_to_json,
    sampling_params,
    turn_record,
)
from verst.sessions.store import (
    Session,
    SessionError,
    SessionStore,
    normalize_message,
    parse_answer,
)
from verst.sessions.templates import ChatTokenizer, Message

# One logger for the whole session server, named after the module that builds it.
log = logging.getLogger("verst.sessions.server")


@web.middleware
async def session_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except SessionError as error:
        return web.json_response(error.body(), status=error.status)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body; an empty body is `{}`, anything else a 400."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = loads_json(raw)
    except ValueError as error:
        raise SessionError(400, f"the body is not JSON: {error}", "bad_json") from error
    if not isinstance(body, dict):
        raise SessionError(400, "the body must be a JSON object", "bad_json")
    return body


class UpstreamClient:
    """The engine or router behind the session server; its client session lives with the app."""

    def __init__(
        self, upstream_url: str, *, connect_timeout_s: float, headers: dict[str, str] | None = None
    ) -> None:
        self.url = upstream_url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.headers = headers or {}  # the upstream's Authorization, when it wants one
        self._client: aiohttp.ClientSession | None = None

    @property
    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("the session server's client session opens with the app")
        return self._client

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        self._client = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0), headers=self.headers
        )
        yield
        await self._client.close()

    async def release_key(self, sid: str) -> bool:
        """Unpin the session's routing key; False where there is none to release."""
        try:
            async with self.client.post(self.url + "/release_key", json={"key": sid}) as r:
                if r.status == 404:  # a plain engine has no routing keys to release
                    return False
                body = await r.json(content_type=None)
                return r.status == 200 and bool(body.get("released"))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            log.warning("could not release routing key %s at %s: %s", sid, self.url, error)
            return False

    async def generate(self, sid: str, payload: dict[str, Any]) -> dict[str, Any]:
        """`/generate` with the session id as routing key. The upstream's 4xx (the request was
        bad) is passed through with its message; any other failure is a 502."""
        url = self.url + "/generate"
        try:
            async with self.client.post(url, json=payload, headers={ROUTING_KEY_HEADER: sid}) as r:
                text = await r.text()
                if 400 <= r.status < 500:
                    message = f"upstream refused the request ({r.status}): {text[:2000]}"
                    raise SessionError(r.status, message, "upstream_rejected")
                if not 200 <= r.status < 300:
                    raise SessionError(
                        502, f"upstream {url} answered {r.status}: {text[:2000]}", "bad_upstream"
                    )
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            message = f"upstream {url} is unreachable: {type(error).__name__}: {error}"
            raise SessionError(502, message, "bad_upstream") from error
        try:
            result = json.loads(text)
        except ValueError as error:
            raise SessionError(502, f"upstream {url} answered non-JSON", "bad_upstream") from error
        if isinstance(result, list) and len(result) == 1:
            result = result[0]
        if not isinstance(result, dict):
            raise SessionError(502, f"upstream {url} answered {text[:200]}", "bad_upstream")
        return result


class SessionHandlers:
    """The routes of the session server over a `SessionStore` and its upstream."""

    def __init__(
        self,
        store: SessionStore,
        chat_tokenizer: ChatTokenizer,
        upstream: UpstreamClient,
        *,
        model_name: str,
        lora_path: str | None = None,
        routed_experts: bool = False,
    ) -> None:
        self.store = store
        self.chat_tokenizer = chat_tokenizer
        self.upstream = upstream
        self.model_name = model_name
        self.lora_path = lora_path  # the LoRA adapter every turn runs with (None: the base)
        self.routed_experts = routed_experts  # ask for every turn's experts (MoE replay)

    async def create(self, request: web.Request) -> web.Response:
        return web.json_response({"session_id": self.store.create().session_id})

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.get(request.match_info["sid"]).summary())

    async def delete(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        async with self.store.get(sid).lock:  # waits for a chat in flight
            self.store.delete(sid)
        released = await self.upstream.release_key(sid)
        return web.json_response({"session_id": sid, "deleted": True, "key_released": released})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info["sid"]
        session = self.store.get(sid)
        body = await read_json(request)
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list):
            raise SessionError(400, "messages must be a list", "bad_messages")
        messages = [normalize_message(m) for m in raw_messages]
        tools = body.get("tools") or None
        params = sampling_params(body, self.chat_tokenizer.format.stop_ids)
        async with session.lock:
            self.store.get(sid)  # deleted while this request waited for the lock
            turn = await self._answer(sid, session, messages, tools, params)
        decode = self.chat_tokenizer.tokenizer.decode
        logprobs = chat_logprobs(turn.record, decode) if body.get("logprobs") else None
        if not body.get("stream"):
            return web.json_response(chat_completion(turn, body, self.model_name, logprobs))
        chunk = chat_chunk(turn, body, self.model_name, logprobs)
        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await stream.prepare(request)
        await stream.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        await stream.write_eof()
        return stream

    async def _answer(
        self,
        sid: str,
        session: Session,
        messages: list[Message],
        tools: list[dict] | None,
        params: dict[str, Any],
    ) -> ChatTurn:
        """Plan the turn, generate it upstream and commit it; the caller holds the lock."""
        # Rendering and tokenizing a long history takes seconds: never on the event loop.
        plan = await asyncio.to_thread(self.store.plan_turn, session, messages, tools)
        payload = {"input_ids": plan.input_ids, "sampling_params": params}
        if self.lora_path is not None:
            payload["lora_path"] = self.lora_path
        if self.routed_experts:
            payload["return_routed_experts"] = True
        result = await self.upstream.generate(sid, {**payload, "return_logprob": True})
        record = turn_record(plan.input_ids, result)
        text = result.get("text")
        if not isinstance(text, str):
            text = self.chat_tokenizer.tokenizer.decode(record.output_ids, skip_special_tokens=True)
        content, calls = parse_answer(self.chat_tokenizer, text, record.output_ids, tools)
        cached = int(result["meta_info"].get("cached_tokens", 0) or 0)
        self.store.commit(session, plan, record, answer_message(content, calls), cached)
        index = len(session.records) - 1
        return ChatTurn(sid, index, record, content, calls, cached)

    async def samples(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        body = await read_json(request)
        max_seq_len = body.get("max_seq_len")
        if max_seq_len is not None and (
            not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool)
        ):
            raise SessionError(400, "max_seq_len must be an integer or null", "bad_max_seq_len")
        async with self.store.get(sid).lock:
            try:
                sample = self.store.assemble(sid, max_seq_len)
            except AssemblyError as error:
                raise SessionError(422, str(error), "assembly_failed") from error
        return web.json_response({"session_id": sid, **sample_to_json(sample)})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.store.sessions)})
