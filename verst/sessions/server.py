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
`verst sessions`. This module owns the route table: the handlers live in
`verst.sessions.handlers` (imported with aiohttp only when an app is built, so importing this
module does not need the `serve` extra) and the request and response bodies in
`verst.sessions.openai_chat`.
Errors: 404 unknown (or expired) session, 400 bad request or history, 408 body too slow, 413 body
too large, 422 nothing to assemble, 429 too many sessions, the upstream's own 4xx when it
refused the request, 502 any other upstream failure (with the upstream's message).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verst.auth import ApiKeys, auth_middleware, warn_if_open
from verst.http_limits import HttpLimits, limited_app
from verst.sessions.store import MAX_SESSIONS, SESSION_TTL_S, SessionStore
from verst.sessions.templates import ChatTokenizer

if TYPE_CHECKING:
    from aiohttp import web


def make_session_app(
    upstream_url: str,
    chat_tokenizer: ChatTokenizer,
    *,
    model_name: str,
    store: SessionStore | None = None,
    connect_timeout_s: float = 5.0,
    api_keys: ApiKeys | None = None,
    upstream_keys: ApiKeys | None = None,
    limits: HttpLimits | None = None,
    lora_path: str | None = None,
    routed_experts: bool = False,
) -> web.Application:
    """The session server over a router or engine at `upstream_url` (SGLang's `/generate`).
    Pass `store` to share the sessions with in-process code (e.g. to assemble directly); its
    `ttl_s` and `max_sessions` bound the sessions kept. `api_keys` guard every route but
    `/health`; `upstream_keys` (default: the same) are sent upstream. With `lora_path`, every
    turn is generated with that LoRA adapter of the engines; with `routed_experts`, every turn
    asks for the experts of its tokens and the assembled sample carries them."""
    try:
        import aiohttp  # noqa: F401  (the import error names the extra)
    except ImportError as error:
        raise ImportError("the session server needs aiohttp: pip install 'verst[serve]'") from error
    from verst.sessions.handlers import SessionHandlers, UpstreamClient, session_errors

    api_keys = api_keys or ApiKeys()
    upstream = UpstreamClient(
        upstream_url,
        connect_timeout_s=connect_timeout_s,
        headers=(upstream_keys if upstream_keys is not None else api_keys).headers(),
    )
    store = store or SessionStore(chat_tokenizer)
    h = SessionHandlers(
        store,
        chat_tokenizer,
        upstream,
        model_name=model_name,
        lora_path=lora_path,
        routed_experts=routed_experts,
    )
    middlewares: list = [session_errors]
    if api_keys.enabled:
        middlewares.insert(0, auth_middleware(api_keys, lambda request: False))
    limits = limits or HttpLimits()
    # A chat whose client left is cancelled (its upstream request closed, so aborted); a
    # DELETE still releases the routing key.
    app = limited_app(limits, *middlewares, cancellable=lambda p: p.endswith("/completions"))
    app.router.add_post("/sessions", h.create)
    app.router.add_get("/sessions/{sid}", h.get)
    app.router.add_delete("/sessions/{sid}", h.delete)
    app.router.add_post("/sessions/{sid}/v1/chat/completions", h.chat)
    app.router.add_post("/sessions/{sid}/samples", h.samples)
    app.router.add_get("/health", h.health)
    app.cleanup_ctx.append(upstream.lifecycle)
    return app


def run_session_server(
    upstream_url: str,
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30200,
    model_name: str | None = None,
    limits: HttpLimits | None = None,
    ttl_s: float = SESSION_TTL_S,
    max_sessions: int = MAX_SESSIONS,
    api_keys: ApiKeys | None = None,
    family: str | None = None,
) -> None:
    """Serve sessions until interrupted, with the chat template of the model in `model_dir`
    (of chat-template family `family`; None: detected from the template)."""
    from transformers import AutoTokenizer

    from verst.http_limits import run_app

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    chat_tokenizer = ChatTokenizer(tokenizer, family=family)
    store = SessionStore(chat_tokenizer, ttl_s=ttl_s, max_sessions=max_sessions)
    limits = limits or HttpLimits()
    app = make_session_app(
        upstream_url,
        chat_tokenizer,
        model_name=model_name or model_dir,
        store=store,
        api_keys=api_keys,
        limits=limits,
    )
    warn_if_open("verst sessions", host, api_keys or ApiKeys())
    run_app(app, host=host, port=port, limits=limits)
