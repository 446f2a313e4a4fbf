"""The router as an aiohttp reverse proxy in front of engine servers (`make_router_app`) and
`verst route` (`run_router`).

Every request not handled here is forwarded to the engine the `Router` picks from the request's
`X-SMG-Routing-Key` header: bodies and status codes pass through unchanged, server-sent events
chunk by chunk. Control requests that concern the whole fleet (pause, continue, flush, weight
updates, abort) are sent to every engine and answered 200 only when all of them succeeded. A
background task polls each engine's `/health` and takes an engine out of routing after
`health_failures` failed polls in a row; its keys move on their next request, and the engine
comes back on its first healthy answer.

This module owns the route table; the handlers live in `verst.router.handlers`, imported with
aiohttp when an app is built, so importing this module does not need the `serve` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verst.auth import ApiKeys, auth_middleware, warn_if_open
from verst.engine.server.app import is_control_request
from verst.http_limits import HttpLimits, limited_app
from verst.router.policy import Router

if TYPE_CHECKING:
    from aiohttp import web

BROADCAST_PATHS = (
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/abort_request",
)
# Routes that steer the router or the whole fleet: the admin key's, when one is set.
WORKER_PATHS = ("/add_worker", "/remove_worker")


async def is_router_control(request: Any) -> bool:
    return request.path in WORKER_PATHS or await is_control_request(request)


_RUN_TO_END = frozenset({*BROADCAST_PATHS, *WORKER_PATHS, "/release_key"})


def _proxied(path: str) -> bool:
    """A proxied request is cancelled (and aborted upstream) when its client leaves; the
    router's own and fleet-wide routes run to their end."""
    return path not in _RUN_TO_END


def make_router_app(
    router: Router,
    *,
    health_interval_s: float = 5.0,
    health_failures: int = 3,
    health_timeout_s: float = 5.0,
    connect_timeout_s: float = 5.0,
    api_keys: ApiKeys | None = None,
    engine_keys: ApiKeys | None = None,
    limits: HttpLimits | None = None,
) -> web.Application:
    """The proxy app over `router`; its health checker runs while the app runs. `api_keys`
    guard the router's own routes; `engine_keys` (default: the same) go to the engines in place
    of the client's `Authorization`. Serve it with `verst.http_limits.runner_kwargs` so a
    client that disconnects aborts its request."""
    try:
        import aiohttp  # noqa: F401  (the import error names the extra)
    except ImportError as error:
        raise ImportError("the verst router needs aiohttp: pip install 'verst[serve]'") from error
    from verst.router.handlers import HealthChecker, RouterHandlers

    checker = HealthChecker(
        router, interval_s=health_interval_s, failures=health_failures, timeout_s=health_timeout_s
    )
    api_keys = api_keys or ApiKeys()
    handlers = RouterHandlers(
        router,
        checker,
        connect_timeout_s=connect_timeout_s,
        engine_keys=engine_keys if engine_keys is not None else api_keys,
    )
    middlewares = [auth_middleware(api_keys, is_router_control)] if api_keys.enabled else []
    limits = limits or HttpLimits()
    app = limited_app(limits, *middlewares, cancellable=_proxied)
    for path in BROADCAST_PATHS:
        app.router.add_post(path, handlers.broadcast)
    app.router.add_get("/flush_cache", handlers.broadcast)
    app.router.add_post("/add_worker", handlers.add_worker)
    app.router.add_post("/remove_worker", handlers.remove_worker)
    app.router.add_get("/workers", handlers.workers)
    app.router.add_get("/list_workers", handlers.list_workers)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/health", handlers.health)
    app.router.add_post("/release_key", handlers.release_key)
    app.router.add_route("*", "/{tail:.*}", handlers.proxy)
    app.cleanup_ctx.append(handlers.lifecycle)
    return app


def run_router(
    engines: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 30100,
    sessions: bool = False,
    health_interval_s: float = 5.0,
    health_failures: int = 3,
    limits: HttpLimits | None = None,
    api_keys: ApiKeys | None = None,
) -> None:
    """Serve the router until interrupted (SIGINT / SIGTERM)."""
    from verst.http_limits import run_app

    router = Router(engines, sessions=sessions)
    limits = limits or HttpLimits()
    app = make_router_app(
        router,
        health_interval_s=health_interval_s,
        health_failures=health_failures,
        limits=limits,
        api_keys=api_keys,
    )
    warn_if_open("verst route", host, api_keys or ApiKeys())
    mode = "sessions (key required)" if sessions else "least active requests"
    print(
        f"verst route: {len(router.engines)} engine(s) on http://{host}:{port}, {mode}",
        flush=True,
    )
    run_app(app, host=host, port=port, limits=limits)
