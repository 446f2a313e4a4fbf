"""`verst dashboard RUN_DIR [RUN_DIR ...] [--port P]`: the live page of one or several runs
(aiohttp, `pip install -e '.[serve]'`).

Routes: `/` the page, `/static/<file>` its script, style and the vendored uPlot (MIT, served
from the package: no CDN, no build step), `/api/runs` the runs, `/api/run/<i>?cursor=N` a run's
update since the page's last poll (`verst.monitor.dashboard.data.RunSource.poll`),
`/api/samples/<i>?step=S` a step's recorded samples. The page polls, so it follows a running run
and shows a finished one the same way; run directories that do not exist yet are polled too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from verst.monitor.dashboard.data import RunSource

if TYPE_CHECKING:
    from aiohttp import web

STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's name on the page: its directory's name, or its path where names repeat."""
    names = [d.resolve().name or str(d) for d in run_dirs]
    return [str(d) if names.count(n) > 1 else n for d, n in zip(run_dirs, names, strict=True)]


def _static(name: str) -> tuple[bytes, str] | None:
    folder = resources.files("verst.monitor.dashboard") / "static"
    path = folder / name
    suffix = Path(name).suffix
    if "/" in name or suffix not in STATIC_TYPES or not path.is_file():
        return None
    return path.read_bytes(), STATIC_TYPES[suffix]


def _run(runs: list[RunSource], request: web.Request) -> RunSource:
    from aiohttp import web

    try:
        return runs[int(request.match_info["run"])]
    except (ValueError, IndexError):
        raise web.HTTPNotFound(text=f"no run {request.match_info['run']!r}") from None


def _int_query(request: web.Request, name: str, default: int) -> int:
    from aiohttp import web

    try:
        return int(request.query.get(name, default))
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be an integer") from None


def build_app(run_dirs: list[Path]) -> web.Application:
    try:
        from aiohttp import web
    except ImportError as error:
        raise ImportError("verst dashboard needs aiohttp: pip install 'verst[serve]'") from error

    runs = [RunSource(d, label) for d, label in zip(run_dirs, run_labels(run_dirs), strict=True)]

    async def page(request: web.Request) -> web.Response:
        name = request.match_info.get("name", "index.html")
        found = _static(name)
        if found is None:
            raise web.HTTPNotFound(text=f"no file {name!r}")
        return web.Response(body=found[0], content_type=found[1])

    async def run_list(request: web.Request) -> web.Response:
        listing = [
            {"id": i, "label": r.label, "run_dir": str(r.run_dir)} for i, r in enumerate(runs)
        ]
        return web.json_response(listing)

    async def poll(request: web.Request) -> web.Response:
        run = _run(runs, request)
        cursor = _int_query(request, "cursor", 0)
        return web.json_response(await asyncio.to_thread(run.poll, cursor))

    async def samples(request: web.Request) -> web.Response:
        run = _run(runs, request)
        step = _int_query(request, "step", 0)
        found = await asyncio.to_thread(run.samples, step)
        return web.json_response({"step": step, "samples": found})

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/static/{name}", page)
    app.router.add_get("/api/runs", run_list)
    app.router.add_get("/api/run/{run}", poll)
    app.router.add_get("/api/samples/{run}", samples)
    return app


def serve(
    run_dirs: list[Path], *, host: str, port: int, announce: Callable[[str], None] = print
) -> None:
    """Serve the page until interrupted; `announce` gets the address once it listens (port 0
    picks a free one)."""
    app = build_app(run_dirs)
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
        announce(f"verst dashboard: {len(run_dirs)} run(s) at http://{host}:{bound[1]}/")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
