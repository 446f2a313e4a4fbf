"""The token-in-token-out (TITO) session server: an OpenAI-compatible chat API per session that
records exactly what the engine saw and sampled, and assembles it into training Samples.

An agent only sees `base_url = http://host:port/sessions/{id}/v1`. The server owns the history:
each request's messages must extend the stored ones append-only (the model's own earlier
answers unchanged), except that the last assistant turn may be rolled back once. The first
turn is rendered with the chat template; every later turn reuses the stored ids (last input +
output) verbatim and tokenises only the new messages (`ChatTokenizer.extend`), so the ids sent
upstream always extend the ids of the turn before. Requests go to an engine or router's
`/generate` with the session id as routing key (`X-SMG-Routing-Key`), and each answer is kept
as a `TurnRecord`: output ids, log-probs, weight version, finish reason.

`SessionStore` (`verst.sessions.store`) holds the state and the history rules and can be used
in-process; `make_session_app` puts HTTP in front of it and `run_session_server` is
`verst sessions`.
Errors: 404 unknown session, 400 bad request or history, 422 nothing to assemble, 502 upstream
failure (with the upstream's message).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from verst.router.policy import ROUTING_KEY_HEADER
from verst.sessions.assembly import AssemblyError, TurnRecord
from verst.sessions.store import SessionError, SessionStore, normalize_message, parse_tool_calls
from verst.sessions.templates import ChatTokenizer, Message
from verst.types import Sample

if TYPE_CHECKING:
    from aiohttp import ClientSession, web

log = logging.getLogger(__name__)

# OpenAI request keys mapped onto SGLang's sampling_params; everything else OpenAI defines
# that changes sampling is refused rather than silently ignored.
_SAMPLING_KEYS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "sampling_seed",
}
_UNSUPPORTED_KEYS = ("logit_bias", "response_format", "presence_penalty", "frequency_penalty")


def sample_to_json(sample: Sample) -> dict[str, Any]:
    return {
        "tokens": sample.tokens,
        "prompt_length": sample.prompt_length,
        "response_length": sample.response_length,
        "loss_mask": sample.loss_mask,
        "rollout_logprobs": sample.rollout_logprobs,
        "weight_versions": sample.weight_versions,
        "status": sample.status.value,
        "mismatch": sample.metadata.get("mismatch"),
        "metadata": sample.metadata,
    }


def sampling_params(body: dict[str, Any], end_of_turn_id: int) -> dict[str, Any]:
    """OpenAI chat parameters → SGLang sampling_params; the end-of-turn id always stops."""
    if body.get("n", 1) != 1:
        raise SessionError(400, "n must be 1: a session is one trajectory", "bad_n")
    for key in _UNSUPPORTED_KEYS:
        if body.get(key) not in (None, 0, 0.0):
            raise SessionError(400, f"{key} is not supported by the session server", "bad_param")
    params: dict[str, Any] = {}
    for key, name in _SAMPLING_KEYS.items():
        if body.get(key) is not None:
            params[name] = body[key]
    stop = body.get("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    extra = body.get("stop_token_ids") or []
    params["stop_token_ids"] = [end_of_turn_id] + [i for i in extra if i != end_of_turn_id]
    return params


def _weight_version(meta: dict[str, Any]) -> int | str:
    """The oldest version that made any token of the turn, so staleness is never understated
    when an update lands mid-turn."""
    spans = meta.get("weight_versions") or []
    version = spans[0]["version"] if spans else meta.get("weight_version", 0)
    try:
        return int(version)
    except (TypeError, ValueError):
        return version


def turn_record(input_ids: list[int], result: dict[str, Any]) -> TurnRecord:
    """An upstream `/generate` answer → the turn's record; a malformed answer is a 502."""
    try:
        meta = result["meta_info"]
        output_ids = [int(i) for i in result["output_ids"]]
        triples = meta["output_token_logprobs"]
        finish = meta["finish_reason"]
        finish_type = finish["type"] if isinstance(finish, dict) else str(finish)
    except (KeyError, TypeError, ValueError) as error:
        raise SessionError(
            502, f"the upstream answer lacks {error} (output_ids / meta_info)", "bad_upstream"
        ) from error
    if [int(t[1]) for t in triples] != output_ids:
        raise SessionError(
            502, "the upstream's output_token_logprobs do not match its output_ids", "bad_upstream"
        )
    logprobs = [float(t[0]) for t in triples]
    return TurnRecord(list(input_ids), output_ids, logprobs, _weight_version(meta), finish_type)


def make_session_app(
    upstream_url: str,
    chat_tokenizer: ChatTokenizer,
    *,
    model_name: str,
    store: SessionStore | None = None,
    connect_timeout_s: float = 5.0,
) -> web.Application:
    """The session server over a router or engine at `upstream_url` (SGLang's `/generate`).
    Pass `store` to share the sessions with in-process code (e.g. to assemble directly)."""
    try:
        import aiohttp
        from aiohttp import web
    except ImportError as error:
        raise ImportError("the session server needs aiohttp: pip install 'verst[serve]'") from error

    upstream = upstream_url.rstrip("/")
    store = store or SessionStore(chat_tokenizer)
    state: dict[str, ClientSession] = {}

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except SessionError as error:
            return web.json_response(error.body(), status=error.status)

    async def read_json(request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as error:
            raise SessionError(400, f"the body is not JSON: {error}", "bad_json") from error
        if not isinstance(body, dict):
            raise SessionError(400, "the body must be a JSON object", "bad_json")
        return body

    async def create(request: web.Request) -> web.Response:
        return web.json_response({"session_id": store.create().session_id})

    async def get(request: web.Request) -> web.Response:
        return web.json_response(store.get(request.match_info["sid"]).summary())

    async def delete(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        async with store.get(sid).lock:  # waits for a chat in flight
            store.delete(sid)
        released = await release_key(sid)
        return web.json_response({"session_id": sid, "deleted": True, "key_released": released})

    async def release_key(sid: str) -> bool:
        try:
            async with state["client"].post(upstream + "/release_key", json={"key": sid}) as r:
                if r.status == 404:  # a plain engine has no routing keys to release
                    return False
                body = await r.json(content_type=None)
                return r.status == 200 and bool(body.get("released"))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            log.warning("could not release routing key %s at %s: %s", sid, upstream, error)
            return False

    async def generate(sid: str, payload: dict[str, Any]) -> dict[str, Any]:
        url = upstream + "/generate"
        try:
            async with state["client"].post(
                url, json=payload, headers={ROUTING_KEY_HEADER: sid}
            ) as r:
                text = await r.text()
                if not 200 <= r.status < 300:
                    raise SessionError(
                        502, f"upstream {url} answered {r.status}: {text}", "bad_upstream"
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

    async def chat(request: web.Request) -> web.StreamResponse:
        sid = request.match_info["sid"]
        session = store.get(sid)
        body = await read_json(request)
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list):
            raise SessionError(400, "messages must be a list", "bad_messages")
        messages = [normalize_message(m) for m in raw_messages]
        tools = body.get("tools") or None
        params = sampling_params(body, chat_tokenizer.format.end_of_turn_id)
        async with session.lock:
            store.get(sid)  # deleted while this request waited for the lock
            plan = store.plan_turn(session, messages, tools)
            payload = {"input_ids": plan.input_ids, "sampling_params": params}
            result = await generate(sid, {**payload, "return_logprob": True})
            record = turn_record(plan.input_ids, result)
            text = result.get("text")
            if not isinstance(text, str):
                text = chat_tokenizer.tokenizer.decode(record.output_ids, skip_special_tokens=True)
            content, calls = parse_tool_calls(text) if tools else (text, [])
            answer: Message = {"role": "assistant", "content": content}
            if calls:
                answer["tool_calls"] = calls
            cached = int(result["meta_info"].get("cached_tokens", 0) or 0)
            store.commit(session, plan, record, answer, cached)
            turn = len(session.records) - 1
        finish = record.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        logprobs = None
        if body.get("logprobs"):
            decode = chat_tokenizer.tokenizer.decode
            logprobs = {
                "content": [
                    {"token": tok, "bytes": list(tok.encode()), "logprob": lp, "top_logprobs": []}
                    for tok, lp in (
                        (decode([i]), lp)
                        for i, lp in zip(record.output_ids, record.output_logprobs, strict=True)
                    )
                ]
            }
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": body.get("model") or model_name,
        }
        usage = {
            "prompt_tokens": len(record.input_ids),
            "completion_tokens": len(record.output_ids),
            "total_tokens": len(record.total_ids),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        metadata = {"session_id": sid, "turn": turn, "weight_version": record.weight_version}
        message = {**answer, "tool_calls": calls or None}
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            response = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
            return web.json_response({**response, "metadata": metadata})
        delta: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        chunk = {
            **head,
            "object": "chat.completion.chunk",
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
            "usage": usage,
        }
        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await stream.prepare(request)
        await stream.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        await stream.write_eof()
        return stream

    async def samples(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        body = await read_json(request)
        max_seq_len = body.get("max_seq_len")
        if max_seq_len is not None and (
            not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool)
        ):
            raise SessionError(400, "max_seq_len must be an integer or null", "bad_max_seq_len")
        async with store.get(sid).lock:
            try:
                sample = store.assemble(sid, max_seq_len)
            except AssemblyError as error:
                raise SessionError(422, str(error), "assembly_failed") from error
        return web.json_response({"session_id": sid, **sample_to_json(sample)})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(store.sessions)})

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        state["client"] = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        )
        yield
        await state["client"].close()

    app = web.Application(middlewares=[errors], client_max_size=1 << 28)
    app.router.add_post("/sessions", create)
    app.router.add_get("/sessions/{sid}", get)
    app.router.add_delete("/sessions/{sid}", delete)
    app.router.add_post("/sessions/{sid}/v1/chat/completions", chat)
    app.router.add_post("/sessions/{sid}/samples", samples)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(lifecycle)
    return app


def run_session_server(
    upstream_url: str,
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30200,
    model_name: str | None = None,
) -> None:
    """Serve sessions until interrupted, with the chat template of the model in `model_dir`."""
    from aiohttp import web
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    app = make_session_app(
        upstream_url, ChatTokenizer(tokenizer), model_name=model_name or model_dir
    )
    web.run_app(app, host=host, port=port, print=lambda *_: None)
