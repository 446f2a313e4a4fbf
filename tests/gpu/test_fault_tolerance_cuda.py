"""Engine processes on the trainer's GPU killed at random points of steps: CUDA IPC pushes reach
the restarted engine, and fully asynchronous mode on one GPU survives the same."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.faults import TrainProcess
from tests.gpu.test_cuda_loop import SMALL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("aiohttp")

ENGINES = [
    *SMALL,
    "num_steps=600",  # an engine process takes seconds to start on a GPU: outlast two restarts
    "eval.interval_steps=0",
    "warm_start.enabled=false",
    "placement.engines=processes",
    "placement.num_engines=2",
    "fault_tolerance.interval_s=0.5",
    "fault_tolerance.timeout_s=10",
]
RUNS = {
    "cuda_ipc": ["sync.transport=colocated"],
    "fully_async_disk": [
        "mode=fully_async",
        "num_steps=1000",
        "placement.mode=disaggregated",
        "placement.engine_devices=[cuda:0]",
        "sync.transport=disk",
    ],
}


@pytest.mark.parametrize("name", list(RUNS))
def test_engines_killed_on_the_gpu_are_restarted(tmp_path: Path, name: str) -> None:
    run = TrainProcess([*ENGINES, *RUNS[name]], tmp_path / "run").start()
    rng = random.Random(0)
    for step in (2, 30):
        run.kill_engine(step, rng)
    assert run.finish() == 0, run.output()
    rows = run.records()
    assert rows[-1]["fault/engine_restarts"] >= 2
    assert [r["step"] for r in rows] == list(range(len(rows)))
    if name == "cuda_ipc":  # bf16 engines and trainer: the restarted engine got the weights
        assert all(r["train/train_rollout_logprob_abs_diff"] < 5e-2 for r in rows[1:])
