"""The router's HTTP handlers (`RouterHandlers`) and its engine health checker (`HealthChecker`).

`verst.router.server.make_router_app` builds one `RouterHandlers` per app and registers its
methods as routes. This module imports aiohttp at the top: only the app factory imports it, so
`verst.router.server` itself stays importable without the `serve` extra.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from verst.auth import ApiKeys
from verst.engine.server.app import is_control_request
from verst.http_limits import loads_json
from verst.router.policy import (
    ROUTING_KEY_HEADER,
    MissingRoutingKey,
    NoEngineAvailable,
    Router,
    split_rank,
    validate_engine_url,
)

# One logger for the whole router app, named after the module that builds it.
log = logging.getLogger("verst.router.server")

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


def json_error(status: int, message: str, code: str, kind: str) -> web.Response:
    """The gateway envelope as a response, its code repeated in `X-SMG-Error-Code`."""
    return web.json_response(
        error_body(message, code=code, kind=kind),
        status=status,
        headers={"X-SMG-Error-Code": code},
    )


def _kept_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_HEADERS}


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


class HealthChecker:
    """Polls each engine's `/health`; `failures` failed polls in a row take an engine out of
    routing, its first healthy answer brings it back."""

    def __init__(
        self, router: Router, *, interval_s: float, failures: int, timeout_s: float
    ) -> None:
        self.router = router
        self.interval_s = interval_s
        self.max_failures = failures
        self.timeout_s = timeout_s
        self.failures: dict[str, int] = {}  # base URL → consecutive failed health polls

    def mark_down(self, base: str) -> None:
        """An engine that failed a proxied request leaves routing at once."""
        self.failures[base] = max(self.failures.get(base, 0), self.max_failures)
        if self.router.set_healthy(base, False):
            log.warning("engine %s is unreachable: taken out of routing", base)

    def forget(self, base: str) -> None:
        self.failures.pop(base, None)

    async def poll(self, session: aiohttp.ClientSession, base: str) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with session.get(base + "/health", timeout=timeout) as r:
                ok = 200 <= r.status < 300
        except Exception:  # any URL or answer at all: one bad engine never stops the checker
            ok = False
        router = self.router
        if ok:
            self.failures[base] = 0
            if not router.is_healthy(base) and router.set_healthy(base, True):
                log.warning("engine %s answers again: back in routing", base)
            return
        self.failures[base] = self.failures.get(base, 0) + 1
        if self.failures[base] >= self.max_failures and router.is_healthy(base):
            router.set_healthy(base, False)
            log.warning(
                "engine %s failed %d health checks: out of routing", base, self.failures[base]
            )

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            polls = (self.poll(session, base) for base in self.router.base_urls())
            for outcome in await asyncio.gather(*polls, return_exceptions=True):
                if isinstance(outcome, Exception):
                    log.warning("health check failed: %s: %s", type(outcome).__name__, outcome)
            await asyncio.sleep(self.interval_s)


class RouterHandlers:
    """One method per route of the router app, over the `Router`, the health checker and the
    client session the app's lifecycle opens."""

    def __init__(
        self,
        router: Router,
        checker: HealthChecker,
        *,
        connect_timeout_s: float,
        engine_keys: ApiKeys | None = None,
    ) -> None:
        self.router = router
        self.checker = checker
        self.connect_timeout_s = connect_timeout_s
        self.engine_keys = engine_keys or ApiKeys()
        self._session: aiohttp.ClientSession | None = None
        self._aborts: set[asyncio.Task[None]] = set()  # aborts sent for clients that left

    async def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        """The request's end-to-end headers, its `Authorization` replaced by the engines' key
        when the router has one (a client's key for the router is no key for the engines)."""
        headers = _kept_headers(request.headers)
        if self.engine_keys.enabled:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers.update(self.engine_keys.headers(admin=await is_control_request(request)))
        return headers

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router's client session opens with the app")
        return self._session

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: the client session and the health checker live with the app."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        self._session = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, connector=aiohttp.TCPConnector(limit=0)
        )
        polling = asyncio.create_task(self.checker.run(self._session), name="verst-router-health")
        yield
        if self._aborts:
            await asyncio.wait(self._aborts, timeout=1.0)
        polling.cancel()
        try:
            await polling
        except asyncio.CancelledError:
            pass
        await self._session.close()

    # ---- proxy ---------------------------------------------------------------------------

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get(ROUTING_KEY_HEADER) or None
        try:
            # Reads need no session affinity: a key-less GET never is refused.
            if key is None and request.method in ("GET", "HEAD"):
                target = self.router.least_loaded()
            else:
                target = self.router.pick(key)
        except MissingRoutingKey as error:
            return json_error(400, str(error), "missing_routing_key", "invalid_request_error")
        except NoEngineAvailable as error:
            return json_error(503, str(error), "no_available_workers", "service_unavailable")
        base, rank = split_rank(target)
        body = await request.read()
        if rank is not None and request.path == "/generate":
            body = _with_dp_rank(body, rank)
        headers = await self._upstream_headers(request)
        self.router.begin(target)
        try:
            return await self._forward(request, base, body, headers)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client left: closing the upstream connection already aborts the request in
            # a verst engine; an abort by rid also reaches engines that do not watch for it.
            self._abort_upstream(base, body, headers)
            raise
        finally:
            self.router.end(target)

    def _abort_upstream(self, base: str, body: bytes, headers: dict[str, str]) -> None:
        rids = _rids(body)
        if not rids:
            return
        abort_headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}

        async def abort() -> None:
            for rid in rids:
                try:
                    answer = await self._call(
                        "POST",
                        base + "/abort_request",
                        json.dumps({"rid": rid}).encode(),
                        {**abort_headers, "Content-Type": "application/json"},
                    )
                except aiohttp.ClientError as error:
                    answer = {"status": f"failed: {type(error).__name__}"}
                log.info("client left: aborted rid %s on %s (%s)", rid, base, answer["status"])

        task = asyncio.get_running_loop().create_task(abort(), name="verst-router-abort")
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _forward(
        self, request: web.Request, base: str, body: bytes, headers: dict[str, str]
    ) -> web.StreamResponse:
        url = base + request.rel_url.raw_path_qs
        try:
            upstream = await self.session.request(
                request.method, url, data=body or None, headers=headers
            )
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
            self.checker.mark_down(base)
            message = f"engine {base} is unreachable: {type(error).__name__}: {error}"
            return json_error(502, message, "bad_gateway", "bad_gateway")
        async with upstream:
            out_headers = _kept_headers(upstream.headers)
            if upstream.content_type == "text/event-stream":
                return await self._relay_stream(request, upstream, base, out_headers)
            try:
                payload = await upstream.read()
            except aiohttp.ClientError as error:
                self.checker.mark_down(base)
                message = f"engine {base} broke off its answer: {type(error).__name__}"
                return json_error(502, message, "bad_gateway", "bad_gateway")
            return web.Response(status=upstream.status, body=payload, headers=out_headers)

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        base: str,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
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
                self.checker.mark_down(base)
                return response
            await response.write(chunk)  # a client that left ends the handler here
        await response.write_eof()
        return response

    # ---- fleet-wide control ----------------------------------------------------------------

    async def broadcast(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = await self._upstream_headers(request)
        # Every registered engine, healthy or not: a weight update that skipped a sick engine
        # would let it serve stale weights once it recovers; better to fail loudly here.
        bases = self.router.base_urls()
        path = request.rel_url.raw_path_qs
        answers = await asyncio.gather(
            *(self._call(request.method, base + path, body, headers) for base in bases)
        )
        by_engine = dict(zip(bases, answers, strict=True))
        statuses = [a["status"] for a in answers]
        if any(s is None for s in statuses):
            status = 502
        else:
            status = next((s for s in statuses if not 200 <= s < 300), 200)
        body: dict[str, Any] = {"success": status == 200 and bool(bases), "engines": by_engine}
        if status != 200 or not bases:
            failed = [b for b, a in by_engine.items() if a["status"] != 200]
            message = f"engines that did not answer 200: {failed}" if bases else "no engines"
            kind = "invalid_request_error" if 400 <= status < 500 else "bad_gateway"
            body.update(error_body(message, code="broadcast_failed", kind=kind))
        return web.json_response(body, status=status if bases else 503)

    async def _call(
        self, method: str, url: str, body: bytes, headers: dict[str, str]
    ) -> dict[str, Any]:
        try:
            async with self.session.request(method, url, data=body or None, headers=headers) as r:
                raw = await r.read()
                try:
                    parsed: Any = json.loads(raw) if raw.strip() else None
                except ValueError:
                    parsed = raw.decode(errors="replace")
                return {"status": r.status, "body": parsed}
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
            return {"status": None, "body": f"unreachable: {type(error).__name__}: {error}"}

    # ---- router control --------------------------------------------------------------------

    async def add_worker(self, request: web.Request) -> web.Response:
        """A worker joins only with a valid URL, a healthy answer and the same served model and
        weight version as the engines already routed to (SGLang polls before it registers)."""
        try:
            url = validate_engine_url(_url_param(request))
        except ValueError as error:
            return json_error(400, str(error), "bad_url", "invalid_request_error")
        problem = await self._admission_problem(split_rank(url)[0])
        if problem is not None:
            return json_error(400, problem, "worker_rejected", "invalid_request_error")
        added = self.router.add_engine(url)
        self.checker.forget(split_rank(url)[0])
        return web.json_response({"status": "ok", "url": url, "added": added})

    async def _model_info(self, base: str) -> dict[str, Any] | None:
        timeout = aiohttp.ClientTimeout(total=self.checker.timeout_s)
        headers = self.engine_keys.headers()
        try:
            async with self.session.get(base + "/health", timeout=timeout) as r:
                if r.status != 200:
                    return None
            async with self.session.get(
                base + "/model_info", timeout=timeout, headers=headers
            ) as r:
                info = await r.json(content_type=None) if r.status == 200 else None
        except Exception:  # unreachable, not JSON, not an engine: not admitted
            return None
        return info if isinstance(info, dict) else None

    async def _admission_problem(self, base: str) -> str | None:
        info = await self._model_info(base)
        if info is None:
            return f"worker {base} did not pass its health check (/health, then /model_info)"
        peers = {split_rank(t)[0] for t in self.router.live_engines} - {base}
        for peer in sorted(peers):
            reference = await self._model_info(peer)
            if reference is None:
                continue
            for field in ("served_model_name", "weight_version"):
                if str(info.get(field)) != str(reference.get(field)):
                    return (
                        f"worker {base} serves {field} {info.get(field)!r}, the fleet "
                        f"{reference.get(field)!r}"
                    )
            break
        return None

    async def remove_worker(self, request: web.Request) -> web.Response:
        url = _url_param(request)
        removed = self.router.remove_engine(url)
        if not removed:
            message = f"no worker {url} is registered"
            return json_error(404, message, "worker_not_found", "not_found")
        return web.json_response({"status": "ok", "removed": removed})

    async def workers(self, request: web.Request) -> web.Response:
        engines = self.router.metrics()["engines"]
        return web.json_response({"workers": [{"url": url, **s} for url, s in engines.items()]})

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"urls": self.router.engines})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.json_response(self.router.metrics())

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.router.live_engines else 503)

    async def release_key(self, request: web.Request) -> web.Response:
        try:
            payload = loads_json(await request.read() or b"{}")
        except ValueError:
            payload = None
        key = payload.get("key") if isinstance(payload, dict) else None
        if not isinstance(key, str) or not key:
            message = 'the body must be {"key": "<routing key>"}'
            return json_error(400, message, "bad_key", "invalid_request_error")
        return web.json_response({"key": key, "released": self.router.release(key)})


def _rids(body: bytes) -> list[str]:
    """The request ids a `/generate` (or OpenAI) body names: its `rid`, a string or a list."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return []
    rid = payload.get("rid") if isinstance(payload, dict) else None
    rids = rid if isinstance(rid, list) else [rid]
    return [r for r in rids if isinstance(r, str) and r]


def _url_param(request: web.Request) -> str:
    url = request.query.get("url", "").strip()
    if not url:
        raise web.HTTPBadRequest(
            text=json.dumps(error_body("the query parameter url is required", code="bad_url")),
            content_type="application/json",
        )
    return url
