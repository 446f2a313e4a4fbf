"""Control calls reach a busy engine: more generations in flight than aiohttp's default
connection cap (100) must not hold back a pause, a flush or a version update."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from tests.servers import start_engine, tiny_model  # noqa: E402
from verst.fleet.client import HttpEngineClient  # noqa: E402

IN_FLIGHT = 120


async def update_while_busy(model_dir: Path) -> list[dict]:
    engine = await start_engine(model_dir)
    client = HttpEngineClient(engine.url)
    try:
        body = {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True},
        }
        generations = [asyncio.create_task(client.generate(dict(body))) for _ in range(IN_FLIGHT)]
        while engine.serving.load()["num_running_reqs"] < 100:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(client.pause_generation("retract"), 10)
        assert await asyncio.wait_for(client.flush_cache(), 10)
        await asyncio.wait_for(client.update_weight_version("7"), 10)
        await asyncio.wait_for(client.continue_generation(), 10)
        return await asyncio.wait_for(asyncio.gather(*generations), 120)
    finally:
        await client.close()
        await engine.runner.cleanup()


def test_weight_update_reaches_an_engine_with_more_requests_than_connections(
    tmp_path: Path,
) -> None:
    outputs = asyncio.run(update_while_busy(tiny_model(tmp_path)))
    assert all(o["meta_info"]["completion_tokens"] == 48 for o in outputs)
    spans = [[s["version"] for s in o["meta_info"]["weight_versions"]] for o in outputs]
    # requests in flight across the update carry both versions
    assert any(versions == ["0", "7"] for versions in spans)
