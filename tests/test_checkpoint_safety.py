"""`--resume` loads `trainer_state.pt` with `weights_only=True`: a crafted pickle is refused."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.test_disk_errors import TINY as DISK_ERRORS_RUN
from verst.cli import main
from verst.train.checkpoint import list_checkpoints

TINY = ["num_steps=1", *DISK_ERRORS_RUN]  # one step: its checkpoint is the last one


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (str(self.marker),))


def test_resume_refuses_a_crafted_trainer_state(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "--run-dir", str(run_dir)]) == 0
    state_file = list_checkpoints(run_dir)[-1] / "trainer_state.pt"
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "payload": _Payload(marker)}, state_file)
    assert main(["train", *TINY, "--run-dir", str(run_dir), "--resume"]) == 2
    assert not marker.exists(), "the pickle's payload ran"
    assert "trainer_state.pt" in capsys.readouterr().err


def test_checkpoint_at_end_false_with_no_interval_saves_none(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    no_saves = ["checkpoint.interval_steps=0", "checkpoint.at_end=false"]
    assert main(["train", *TINY, "num_steps=2", *no_saves, "--run-dir", str(run_dir)]) == 0
    assert list_checkpoints(run_dir) == []
    every = ["checkpoint.interval_steps=1", "checkpoint.at_end=false"]
    assert main(["train", *TINY, "num_steps=2", *every, "--run-dir", str(tmp_path / "b")]) == 0
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["step_000001", "step_000002"]
