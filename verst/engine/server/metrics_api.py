"""`GET /metrics`: the engine's Prometheus metrics (`verst.engine.metrics`) in the text format.

Kept apart from the SGLang and OpenAI routes: the handler only renders the engine's own
registry, so a scrape never waits on the serving loop or the scheduler's step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from verst.engine.serving import ServingEngine


def metrics_handler(
    serving: ServingEngine, served_model_name: str
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The `/metrics` handler; the metrics carry `served_model_name` as `model_name`."""
    serving.metrics.model_name = served_model_name

    async def metrics(request: web.Request) -> web.Response:
        response = web.Response(body=serving.metrics.exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return metrics
