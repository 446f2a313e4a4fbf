"""The router as an aiohttp reverse proxy in front of engine servers (`make_router_app`) and
`verst route` (`run_router`).

Every request not handled here is forwarded to the engine the `Router` picks from the request's
`X-SMG-Routing-Key` header: bodies and status codes pass through unchanged, server-sent events
chunk by chunk. Control requests that concern the whole fleet (pause, continue, flush, weight
updates, abort) are sent to every engine and answered 200 only when all of them succeeded. A
background task polls each engine's `/health` and takes an engine out of routing after
`health_failures` failed polls in a row; its keys move on their next request, and the engine
comes back on its first healthy answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from verst.router.policy import (
    ROUTING_KEY_HEADER,
    MissingRoutingKey,
    NoEngineAvailable,
    Router,
    split_rank,
)

if TYPE_CHECKING:
    from aiohttp import ClientSession, web

log = logging.getLogger(__name__)

BROADCAST_PATHS = (
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/abort_request",
)
# Hop-by-hop and framing headers are the proxy's own business on each side.
_DROP_HEADERS = {
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
}


def error_body(message: str, *, code: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """SGLang's gateway error envelope."""
    return {"error": {"type": kind, "code": code, "message": message, "param": None}}


def make_router_app(
    router: Router,
    *,
    health_interval_s: float = 5.0,
    health_failures: int = 3,
    health_timeout_s: float = 5.0,
    connect_timeout_s: float = 5.0,
) -> web.Application:
    """The proxy app over `router`; its health checker runs while the app runs."""
    try:
        import aiohttp
        from aiohttp import web
    except ImportError as error:
        raise ImportError("the verst router needs aiohttp: pip install 'verst[serve]'") from error

    failures: dict[str, int] = {}  # base URL → consecutive failed health polls
    state: dict[str, ClientSession] = {}

    def session() -> ClientSession:
        return state["session"]

    def json_error(status: int, message: str, code: str, kind: str) -> web.Response:
        return web.json_response(
            error_body(message, code=code, kind=kind),
            status=status,
            headers={"X-SMG-Error-Code": code},
        )

    def mark_down(base: str) -> None:
        failures[base] = max(failures.get(base, 0), health_failures)
        if router.set_healthy(base, False):
            log.warning("engine %s is unreachable: taken out of routing", base)

    # ---- proxy ---------------------------------------------------------------------------

    async def proxy(request: web.Request) -> web.StreamResponse:
        key = request.headers.get(ROUTING_KEY_HEADER) or None
        try:
            # Reads need no session affinity: a key-less GET never is refused.
            if key is None and request.method in ("GET", "HEAD"):
                target = router.least_loaded()
            else:
                target = router.pick(key)
        except MissingRoutingKey as error:
            return json_error(400, str(error), "missing_routing_key", "invalid_request_error")
        except NoEngineAvailable as error:
            return json_error(503, str(error), "no_available_workers", "service_unavailable")
        base, rank = split_rank(target)
        body = await request.read()
        if rank is not None and request.path == "/generate":
            body = _with_dp_rank(body, rank)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}
        router.begin(target)
        try:
            return await forward(request, base, body, headers)
        finally:
            router.end(target)

    async def forward(
        request: web.Request, base: str, body: bytes, headers: dict[str, str]
    ) -> web.StreamResponse:
        url = base + request.rel_url.raw_path_qs
        try:
            upstream = await session().request(
                request.method, url, data=body or None, headers=headers
            )
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
            mark_down(base)
            message = f"engine {base} is unreachable: {type(error).__name__}: {error}"
            return json_error(502, message, "bad_gateway", "bad_gateway")
        async with upstream:
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS
            }
            if upstream.content_type != "text/event-stream":
                try:
                    payload = await upstream.read()
                except aiohttp.ClientError as error:
                    mark_down(base)
                    message = f"engine {base} broke off its answer: {type(error).__name__}"
                    return json_error(502, message, "bad_gateway", "bad_gateway")
                return web.Response(status=upstream.status, body=payload, headers=out_headers)
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            await response.prepare(request)
            chunks = upstream.content.iter_any().__aiter__()
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except aiohttp.ClientError:
                    # A started stream cannot change its status: the client sees it end
                    # without `[DONE]`, and the engine leaves routing.
                    mark_down(base)
                    return response
                await response.write(chunk)  # a client that left ends the handler here
            await response.write_eof()
            return response

    # ---- fleet-wide control ----------------------------------------------------------------

    async def call(method: str, url: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
        try:
            async with session().request(method, url, data=body or None, headers=headers) as r:
                raw = await r.read()
                try:
                    parsed: Any = json.loads(raw) if raw.strip() else None
                except ValueError:
                    parsed = raw.decode(errors="replace")
                return {"status": r.status, "body": parsed}
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
            return {"status": None, "body": f"unreachable: {type(error).__name__}: {error}"}

    async def broadcast(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}
        # Every registered engine, healthy or not: a weight update that skipped a sick engine
        # would let it serve stale weights once it recovers; better to fail loudly here.
        bases = router.base_urls()
        answers = await asyncio.gather(
            *(
                call(request.method, base + request.rel_url.raw_path_qs, body, headers)
                for base in bases
            )
        )
        by_engine = dict(zip(bases, answers, strict=True))
        statuses = [a["status"] for a in answers]
        if any(s is None for s in statuses):
            status = 502
        else:
            status = next((s for s in statuses if not 200 <= s < 300), 200)
        return web.json_response(
            {"success": status == 200 and bool(bases), "engines": by_engine},
            status=status if bases else 503,
        )

    # ---- router control --------------------------------------------------------------------

    def url_param(request: web.Request) -> str:
        url = request.query.get("url", "").strip()
        if not url:
            raise web.HTTPBadRequest(
                text=json.dumps(error_body("the query parameter url is required", code="bad_url")),
                content_type="application/json",
            )
        return url

    async def add_worker(request: web.Request) -> web.Response:
        url = url_param(request)
        added = router.add_engine(url)
        failures.pop(split_rank(url)[0], None)
        return web.json_response({"status": "ok", "url": url, "added": added})

    async def remove_worker(request: web.Request) -> web.Response:
        url = url_param(request)
        removed = router.remove_engine(url)
        if not removed:
            message = f"no worker {url} is registered"
            return json_error(404, message, "worker_not_found", "not_found")
        return web.json_response({"status": "ok", "removed": removed})

    async def workers(request: web.Request) -> web.Response:
        engines = router.metrics()["engines"]
        return web.json_response({"workers": [{"url": url, **s} for url, s in engines.items()]})

    async def list_workers(request: web.Request) -> web.Response:
        return web.json_response({"urls": router.engines})

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(router.metrics())

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if router.live_engines else 503)

    async def release_key(request: web.Request) -> web.Response:
        try:
            payload = json.loads(await request.read() or b"{}")
        except ValueError:
            payload = None
        key = payload.get("key") if isinstance(payload, dict) else None
        if not isinstance(key, str) or not key:
            message = 'the body must be {"key": "<routing key>"}'
            return json_error(400, message, "bad_key", "invalid_request_error")
        return web.json_response({"key": key, "released": router.release(key)})

    # ---- health ----------------------------------------------------------------------------

    async def poll(base: str) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=health_timeout_s)
            async with session().get(base + "/health", timeout=timeout) as r:
                ok = 200 <= r.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok = False
        if ok:
            failures[base] = 0
            if not router.is_healthy(base) and router.set_healthy(base, True):
                log.warning("engine %s answers again: back in routing", base)
            return
        failures[base] = failures.get(base, 0) + 1
        if failures[base] >= health_failures and router.is_healthy(base):
            router.set_healthy(base, False)
            log.warning("engine %s failed %d health checks: out of routing", base, failures[base])

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(poll(base) for base in router.base_urls()))
            await asyncio.sleep(health_interval_s)

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        state["session"] = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, connector=aiohttp.TCPConnector(limit=0)
        )
        checker = asyncio.create_task(health_loop(), name="verst-router-health")
        yield
        checker.cancel()
        try:
            await checker
        except asyncio.CancelledError:
            pass
        await state["session"].close()

    app = web.Application(client_max_size=1 << 30)
    for path in BROADCAST_PATHS:
        app.router.add_post(path, broadcast)
    app.router.add_get("/flush_cache", broadcast)
    app.router.add_post("/add_worker", add_worker)
    app.router.add_post("/remove_worker", remove_worker)
    app.router.add_get("/workers", workers)
    app.router.add_get("/list_workers", list_workers)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_post("/release_key", release_key)
    app.router.add_route("*", "/{tail:.*}", proxy)
    app.cleanup_ctx.append(lifecycle)
    return app


def _with_dp_rank(body: bytes, rank: int) -> bytes:
    """SGLang's `routed_dp_rank` set in a JSON object body; any other body is left alone."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict):
        return body
    payload["routed_dp_rank"] = rank
    return json.dumps(payload).encode()


def run_router(
    engines: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 30100,
    sessions: bool = False,
    health_interval_s: float = 5.0,
    health_failures: int = 3,
) -> None:
    """Serve the router until interrupted (SIGINT / SIGTERM)."""
    from aiohttp import web

    router = Router(engines, sessions=sessions)
    app = make_router_app(
        router, health_interval_s=health_interval_s, health_failures=health_failures
    )
    mode = "sessions (key required)" if sessions else "least active requests"
    print(
        f"verst route: {len(router.engines)} engine(s) on http://{host}:{port}, {mode}",
        flush=True,
    )
    web.run_app(app, host=host, port=port, print=None, access_log=None)
