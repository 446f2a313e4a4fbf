"""Every request ends exactly once whatever lands beside it: random interleavings of generate,
abort by rid, abort_all, pause / continue, flush and weight updates on one `ServingEngine`."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from tests.servers import tiny_model
from verst.engine import SamplingParams
from verst.engine.serving import ServingEngine

pytest.importorskip("aiohttp")  # tests.servers (tiny_model) imports it

PAUSE_MODES = ("abort", "retract", "in_place")


async def control_op(serving: ServingEngine, rng: random.Random, model: Path, n: int) -> None:
    await asyncio.sleep(rng.uniform(0, 0.02))
    op = rng.randrange(7)
    if op in (0, 1):
        prefix = f"r{rng.randrange(n)}"
        await serving.abort(prefix, abort_all=op == 1)
        # the adversarial case: a request the abort's prefix matches, right behind it
        params = SamplingParams(max_new_tokens=2, temperature=0.0)
        rid = f"{prefix}_after_{rng.random()}"
        await serving.generate([40, 41], params, rid=rid, return_logprob=False)
    elif op == 2:
        await serving.pause(rng.choice(PAUSE_MODES))  # type: ignore[arg-type]
        await asyncio.sleep(rng.uniform(0, 0.01))
        await serving.flush_cache()
        await serving.resume()
    elif op == 3:
        await serving.flush_cache()
    elif op == 4:
        await serving.update_weight_version(str(rng.randrange(100)), abort_all=rng.random() < 0.5)
    elif op == 5:
        await serving.update_weights_from_disk(str(model), abort_all_requests=rng.random() < 0.5)
    else:
        await serving.resume()


async def one_request(serving: ServingEngine, rng: random.Random, rid: str) -> Any:
    await asyncio.sleep(rng.uniform(0, 0.02))
    params = SamplingParams(max_new_tokens=rng.randrange(1, 12), temperature=0.0)
    return await serving.generate([40, 41, 42], params, rid=rid, return_logprob=False)


async def interleave(model: Path, seed: int, n: int = 40, overlap: bool | None = None) -> None:
    rng = random.Random(seed)
    serving = ServingEngine.from_model_dir(str(model), seed=0, batch_wait_s=0.001, overlap=overlap)
    await serving.start()
    try:
        requests = [one_request(serving, rng, f"r{i}") for i in range(n)]
        controls = [control_op(serving, rng, model, n) for _ in range(n // 2)]
        jobs = [asyncio.ensure_future(c) for c in [*requests, *controls]]
        rng.shuffle(jobs)
        done, pending = await asyncio.wait(jobs, timeout=30)
        await serving.resume()  # a pause left by the last control op must not hold anything
        if pending:
            done2, pending = await asyncio.wait(pending, timeout=10)
            done |= done2
        stuck = [serving.load(), len(pending)]
        assert not pending, f"seed {seed}: {len(pending)} calls never answered; load {stuck}"
        for job in done:
            job.result()  # no call raised
        for _ in range(200):
            if serving.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}:
                break
            await asyncio.sleep(0.01)
        assert serving.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}, seed
        assert not serving.scheduler.has_work(), seed
        assert await serving.flush_cache(), seed
        probe = await asyncio.wait_for(
            serving.generate(
                [1], SamplingParams(max_new_tokens=1), rid="probe", return_logprob=False
            ),
            timeout=10,
        )
        assert probe.to_dict()["meta_info"]["completion_tokens"] == 1
    finally:
        await serving.stop()


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_end_every_request_once(tmp_path: Path, seed: int) -> None:
    asyncio.run(interleave(tiny_model(tmp_path), seed))


def test_an_abort_all_racing_a_new_request_never_loses_it(tmp_path: Path) -> None:
    """The deferred abort reaches the scheduler before the arrivals queued after it."""

    async def race() -> None:
        serving = ServingEngine.from_model_dir(str(tiny_model(tmp_path)), batch_wait_s=0.001)
        await serving.start()
        try:
            for i in range(30):
                params = SamplingParams(max_new_tokens=4, temperature=0.0)
                first = asyncio.ensure_future(
                    serving.generate([40, 41], params, rid=f"a{i}", return_logprob=False)
                )
                await asyncio.sleep(0.001 * (i % 5))
                await serving.abort(None, abort_all=True)
                second = serving.generate([40, 41], params, rid=f"b{i}", return_logprob=False)
                await asyncio.wait_for(asyncio.gather(first, second), timeout=10)
            assert serving.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}
        finally:
            await serving.stop()

    asyncio.run(race())
