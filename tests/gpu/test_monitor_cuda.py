"""Phase timers and the trace on CUDA: sub-phases timed with CUDA events, not host time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpu.test_cuda_loop import SMALL
from verst.cli import main
from verst.monitor.timer import PhaseTimer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_cuda_phase_counts_the_gpu_work_launched_in_it() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    timer = PhaseTimer(device=x.device)
    with timer("launch"):  # returns at once: the host only queues the products
        for _ in range(20):
            x = x @ x / 64
    with timer("idle"):
        pass
    metrics = timer.metrics()
    # host time of the launches would be microseconds; the GPU's is milliseconds
    assert metrics["perf/launch_time_s"] > 1e-3
    assert metrics["perf/idle_time_s"] < metrics["perf/launch_time_s"] / 10


def test_train_sub_phases_on_cuda_fit_in_the_train_phase(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, "monitor.trace=true", "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        parts = [row[f"perf/train_{p}_time_s"] for p in ("forward", "backward", "optimizer")]
        assert all(t > 0 for t in parts), row
        assert sum(parts) <= row["perf/train_time_s"] * 1.01, row
        assert row["perf/tokens_per_s"] > 0
    names = {e["name"] for e in json.loads((run_dir / "trace.json").read_text())}
    assert {"train", "train_forward", "train_backward", "engine step"} <= names


def test_a_cuda_run_logs_its_mfu_and_the_advisor_flags_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        if "record" in row:
            continue
        assert 0 < row["perf/mfu"] < 1, row  # a tiny model: far below the peak
        assert row["advisor/low_mfu"] == (1.0 if row["step"] >= 1 else 0.0), row
