"""Serving-engine placements on CUDA: in-process engines, an engine process on the trainer's
GPU (disk transport), and fully asynchronous mode with that process generating meanwhile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpu.test_cuda_loop import SMALL
from verst.cli import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("aiohttp")

PLACEMENTS = {
    "in_process": ["placement.engines=in_process", "placement.num_engines=2"],
    "process_disk": ["placement.engines=processes", "sync.transport=disk"],
    "fully_async": [
        "mode=fully_async",
        "num_steps=5",
        "placement.engines=processes",
        "placement.mode=disaggregated",
        "placement.engine_devices=[cuda:0]",
        "sync.transport=disk",
    ],
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_serving_placements_train_on_cuda(tmp_path: Path, name: str) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, *PLACEMENTS[name], "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == rows[0]["step"] + len(rows) - 1
    for row in rows[1:]:
        # bf16 engines and bf16 trainer: same weights, unless fully async mode trained on groups
        # generated some updates ago (lr 1e-3 moves these log-probs by ~0.03 an update)
        bound = 5e-2 if row.get("buffer/staleness_max", 0) == 0 else 0.25
        assert row["train/train_rollout_logprob_abs_diff"] < bound
        assert row["sync/resent_engines"] == 0
