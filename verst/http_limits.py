"""The limits every verst HTTP server (`verst serve`, `verst route`, `verst sessions`) applies
to its clients, their CLI flags, and `run_app`, which serves an app under them.

- body size: `client_max_size`; a larger body is answered 413 before it is read whole;
- read timeout: the whole body must arrive within `read_timeout_s` (408 otherwise), so slow
  clients cannot hold sockets and handlers open;
- idle timeout: a connection with no request for `idle_timeout_s` is closed, and so is one
  whose request headers do not arrive whole within it (aiohttp's keep-alive timer);
- a body aiohttp cannot decode (a fake gzip, an unknown encoding) is a 400, not a 500;
- a client that disconnects cancels its handler (aiohttp's `handler_cancellation`), which is
  how the engine aborts the request and the router forwards the abort;
- SIGTERM / SIGINT stop the server within `SHUTDOWN_TIMEOUT_S`, whatever is in flight.

Imports aiohttp only inside the functions that need it, like the app factories.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

SHUTDOWN_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class HttpLimits:
    """What one verst server accepts from a client."""

    max_body_mb: float = 64.0
    read_timeout_s: float = 30.0
    idle_timeout_s: float = 30.0  # above aiohttp clients' 15 s keep-alive, so they close first

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """`--max-body-mb`, `--read-timeout-s`, `--idle-timeout-s` with `HttpLimits`' defaults."""
    d = HttpLimits()
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=d.max_body_mb,
        help=f"largest request body accepted, in MiB (413 beyond; default {d.max_body_mb:g})",
    )
    parser.add_argument(
        "--read-timeout-s",
        type=float,
        default=d.read_timeout_s,
        help=f"a request body must arrive within this (408 beyond; default {d.read_timeout_s:g})",
    )
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=d.idle_timeout_s,
        help="a connection idle, or still sending its headers, this long is closed "
        f"(default {d.idle_timeout_s:g})",
    )


def limits_from_args(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(args.max_body_mb, args.read_timeout_s, args.idle_timeout_s)


def error_json(status: int, message: str, code: str) -> web.Response:
    from aiohttp import web

    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "code": code, "param": None}}
    return web.json_response(body, status=status)


def limited_app(
    limits: HttpLimits, *middlewares: Any, cancellable: Callable[[str], bool] | None = None
) -> web.Application:
    """An aiohttp app under `limits`, its `middlewares` inside the limits' own; on shutdown it
    cancels the handlers still running, so SIGTERM does not wait for a long generation.

    A client that disconnects cancels its handler only where `cancellable(path)` (default:
    everywhere): control routes such as a weight update run to the end whoever left."""
    from aiohttp import web

    handlers: set[asyncio.Task[Any]] = set()
    app = web.Application(
        middlewares=[body_limits(limits, handlers), *middlewares],
        client_max_size=limits.max_body_bytes,
    )
    if cancellable is not None:
        app.middlewares.insert(0, _shielded_unless(cancellable))

    async def cancel_handlers(app: web.Application) -> None:
        for task in list(handlers):
            task.cancel()

    app.on_shutdown.append(cancel_handlers)
    return app


def _shielded_unless(cancellable: Callable[[str], bool]) -> Any:
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if cancellable(request.path):
            return await handler(request)
        return await asyncio.shield(asyncio.ensure_future(handler(request)))

    return middleware


def body_limits(limits: HttpLimits, handlers: set[asyncio.Task[Any]]) -> Any:
    """An aiohttp middleware that reads each body under the read timeout before the handler
    runs (the handler's own `read()` then returns the cached bytes), and keeps each running
    handler's task in `handlers`."""
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is None:
            return await read_then(request, handler)
        handlers.add(task)
        try:
            return await read_then(request, handler)
        finally:
            handlers.discard(task)

    async def read_then(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.can_read_body:
            try:
                if request.content.is_eof():  # all here already: no timer to arm
                    await request.read()
                else:
                    await asyncio.wait_for(request.read(), limits.read_timeout_s)
            except asyncio.TimeoutError:
                message = f"the request body did not arrive within {limits.read_timeout_s:g} s"
                response = error_json(408, message, "request_timeout")
                response.force_close()  # the rest of the body is not waited for
                return response
            except web.HTTPException as error:  # 413: too large
                response = error_json(error.status, error.text or error.reason, "body_too_large")
                response.force_close()
                return response
            except Exception as error:  # a body aiohttp cannot decode (fake gzip, bad chunks)
                message = f"the request body cannot be read: {type(error).__name__}: {error}"
                response = error_json(400, message, "bad_body")
                response.force_close()  # draining the rest would fail the same way
                return response
        try:
            return await handler(request)
        except web.HTTPException as error:
            if error.status < 400 or error.content_type == "application/json":
                raise
            # aiohttp's own refusals (unknown route, wrong method) in the JSON envelope too
            code = (error.reason or "error").lower().replace(" ", "_")
            return error_json(error.status, error.text or error.reason, code)

    return middleware


def loads_json(raw: bytes) -> Any:
    """`json.loads` whose every failure is a ValueError: invalid UTF-8, too deep a nesting
    (RecursionError) and lone surrogates ("\\ud800", which no tokenizer or encoder accepts)."""
    try:
        value = json.loads(raw)
    except RecursionError as error:
        raise ValueError("the JSON is nested too deeply") from error
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as error:
        raise ValueError("the JSON holds a lone surrogate (\\ud800-\\udfff)") from error
    except RecursionError as error:
        raise ValueError("the JSON is nested too deeply") from error
    return value


def runner_kwargs(limits: HttpLimits) -> dict[str, Any]:
    """The `web.AppRunner` / `web.run_app` options that apply `limits`."""
    return {
        "handler_cancellation": True,
        "keepalive_timeout": limits.idle_timeout_s,
        "shutdown_timeout": SHUTDOWN_TIMEOUT_S,
        # after an early answer (408, 413) the rest of a body is drained for at most this
        "lingering_time": 1.0,
    }


def run_app(app: web.Application, *, host: str, port: int, limits: HttpLimits) -> None:
    """Serve `app` until SIGINT / SIGTERM, under `limits`."""
    from aiohttp import web

    web.run_app(app, host=host, port=port, print=None, access_log=None, **runner_kwargs(limits))
