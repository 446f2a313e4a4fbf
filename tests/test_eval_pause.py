"""What `eval.mode: shared` does to the groups in flight in fully async mode: the worker's
pause lets every started group finish into the buffer, starts none meanwhile, and after resume
each prompt is trained once (the prompt ledger), with none lost across the pause."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.test_async_worker import FakeEngine, FakeSource, reward, run, settle, started_groups
from tests.test_eval_modes import ASYNC_ONE_ENGINE, NO_WARM, step_rows
from tests.test_loop import SMALL
from verst.cli import main
from verst.rollout.async_config import AsyncConfig
from verst.rollout.ledger import LEDGER_FILE, TRAINED, check_exactly_once, read_ledger
from verst.rollout.worker_build import build_rollout_worker


def test_pause_finishes_the_groups_in_flight_into_the_buffer_and_starts_none() -> None:
    async def main() -> None:
        source, engine = FakeSource(2), FakeEngine()
        cfg = AsyncConfig(max_inflight=4, buffer_factor=2, max_staleness=2)
        worker = build_rollout_worker(
            cfg,
            source,
            engine,
            reward,
            prompts_per_step=2,
            n_samples_per_prompt=2,
        )
        async with worker:
            await settle()
            engine.release((0, 0))  # group 0 half done, group 1 not started on
            await settle()
            assert started_groups(engine) == {0, 1}
            pausing = asyncio.ensure_future(worker.pause())
            engine.release((1, 0), (1, 1))  # two places free: no group starts while pausing
            await asyncio.sleep(0.05)
            assert not pausing.done() and worker.inflight == 1
            assert started_groups(engine) == {0, 1}
            engine.release((0, 1))
            await asyncio.wait_for(pausing, 1)
            # paused: the engines idle, both groups in flight at the pause are in the buffer
            assert worker.inflight == 0 and len(worker.buffer) == 2
            await asyncio.sleep(0.05)
            assert started_groups(engine) == {0, 1}
            engine.version = 1  # the evaluation ran, the trainer pushed on
            await worker.resume()
            await settle()
            assert started_groups(engine) == {0, 1, 2, 3}
            served = await worker.take(2, current_version=1)
            engine.release((2, 0), (2, 1), (3, 0), (3, 1))
            served += await worker.take(2, current_version=1)
        prompts = [g[0].prompt_id for g in served]
        assert sorted(prompts) == [0, 1, 2, 3]  # each once: none lost nor served twice
        assert [g[0].weight_versions for g in served[:2]] == [[0], [0]]  # crossed the pause

    run(main())


@pytest.mark.slow
def test_shared_eval_pauses_lose_no_group_and_train_none_twice(tmp_path: Path) -> None:
    """Through `verst train`: an evaluation after every step pauses the worker; the groups in
    flight then are trained after it (staleness >= 1), every prompt of the epoch exactly once."""
    pytest.importorskip("aiohttp")
    run_dir = tmp_path / "run"
    overrides = [
        *SMALL,
        *NO_WARM,
        *ASYNC_ONE_ENGINE,
        "num_steps=5",
        "data.max_prompts=12",
        "eval.interval_steps=1",
    ]
    assert main(["train", *overrides, "--run-dir", str(run_dir)]) == 0
    rows = step_rows(run_dir)
    assert max(r["buffer/staleness_max"] for r in rows[1:]) >= 1
    assert not any(k.startswith("eval/skipped_") for r in rows for k in r)
    report = check_exactly_once(run_dir / LEDGER_FILE, 12)
    assert report.ok and 0 in report.complete_epochs, report.summary()
    trained = [x for x in read_ledger(run_dir / LEDGER_FILE) if x["outcome"] == TRAINED]
    assert len(trained) == 5 * 4  # every step's batch, across four evaluation pauses
