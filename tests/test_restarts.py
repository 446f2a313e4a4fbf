"""`verst train --max-restarts N` through the public CLI: a trainer killed by SIGKILL resumes
from its last checkpoint and ends with the weights of a run never interrupted; a crash before
the first checkpoint starts the run over; the supervisor gives up after N restarts, never
restarts what a restart cannot fix, and passes SIGTERM on without restarting.

The supervisor and its trainers are real processes (`python -m verst train`); the crashes are
real signals, sent by the test or by a reward function (`tests/restart_rewards.py`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.test_disk_errors import TINY, steps
from tests.test_loop import records
from verst import exitcodes
from verst.cli import main
from verst.train.checkpoint import list_checkpoints, load_checkpoint

REPO = Path(__file__).parents[1]
RUN = [
    *TINY,
    "num_steps=8",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "rollout.reward=tests.restart_rewards:slow_response_chars",
    "checkpoint.keep_last=2",
]
WITHIN_S = 120.0


def supervised(args: list[str], run_dir: Path, stderr: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "verst", "train", *args, "--run-dir", str(run_dir)]
    with stderr.open("wb") as err:  # a file, not a pipe: nothing blocks on a full buffer
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)


def trainer_of(supervisor: subprocess.Popen[bytes]) -> int | None:
    """The supervisor's child process (the trainer), if one runs now."""
    pid = supervisor.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0]) if children else None


def running_trainer(supervisor: subprocess.Popen[bytes], ready: Callable[[], bool]) -> int:
    """Waits until `ready()` holds while a trainer runs; returns the trainer's pid."""
    deadline = time.monotonic() + WITHIN_S
    while True:
        assert supervisor.poll() is None, f"the supervisor exited early ({supervisor.returncode})"
        assert time.monotonic() < deadline, "timed out"
        pid = trainer_of(supervisor)
        if pid is not None and ready():
            return pid
        time.sleep(0.01)


def newest_checkpoint(run_dir: Path) -> str:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1].name if checkpoints else ""


def finish(supervisor: subprocess.Popen[bytes]) -> int:
    try:
        return supervisor.wait(timeout=WITHIN_S)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


def restart_records(run_dir: Path) -> list[dict]:
    path = run_dir / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # about 20 s on two cores: three processes start
def test_a_killed_trainer_resumes_and_ends_as_an_uninterrupted_run(tmp_path: Path) -> None:
    straight, run_dir, err = tmp_path / "straight", tmp_path / "run", tmp_path / "stderr"
    assert main(["train", *RUN, "--run-dir", str(straight)]) == 0

    supervisor = supervised([*RUN, "--max-restarts", "2"], run_dir, err)
    trainer = running_trainer(supervisor, lambda: newest_checkpoint(run_dir) >= "step_000002")
    os.kill(trainer, signal.SIGKILL)  # mid-step, mid-save: wherever it is
    assert finish(supervisor) == 0, err.read_text()[-3000:]

    (record,) = restart_records(run_dir)
    assert record["exit_status"] == "signal SIGKILL" and record["returncode"] == -9
    assert record["resumed_from"] >= "step_000002"
    restart = "verst: trainer exited with signal SIGKILL; restart 1/2 from checkpoint"
    assert f"{restart} {record['resumed_from']}\n" in err.read_text()
    assert steps(run_dir) == list(range(9))  # each step once
    rows, expected_rows = records(run_dir), records(straight)
    for key in ("rollout/reward_mean", "train/loss", "train/grad_norm"):
        assert [r.get(key) for r in rows] == [r.get(key) for r in expected_rows], key
    assert sum(r["train/grad_norm"] > 0 for r in rows[3:]) >= 3  # the weights kept moving
    final, _ = load_checkpoint(list_checkpoints(run_dir)[-1])
    expected, _ = load_checkpoint(list_checkpoints(straight)[-1])
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name  # bit for bit


@pytest.mark.slow  # about 12 s: two trainers start
def test_a_crash_before_the_first_checkpoint_restarts_from_scratch_then_gives_up(
    tmp_path: Path,
) -> None:
    run_dir, err = tmp_path / "run", tmp_path / "stderr"
    crashing = [*TINY, "num_steps=2", "rollout.reward=tests.restart_rewards:sigkill"]
    supervisor = supervised([*crashing, "--max-restarts", "1"], run_dir, err)
    assert finish(supervisor) == 128 + signal.SIGKILL

    text = err.read_text()
    assert (
        "verst: trainer exited with signal SIGKILL; restart 1/1 from scratch (no checkpoint yet)"
        in text
    )
    assert text.strip().splitlines()[-1] == (
        "verst: error: trainer exited with signal SIGKILL; giving up after 1 restart "
        "(--max-restarts 1)"
    )
    (record,) = restart_records(run_dir)
    assert record["resumed_from"] is None
    assert steps(run_dir) == [0]  # the first attempt's records went with it


@pytest.mark.slow  # about 10 s
def test_a_non_finite_loss_is_not_restarted(tmp_path: Path) -> None:
    """A resume would replay the same steps to the same loss."""
    run_dir, err = tmp_path / "run", tmp_path / "stderr"
    blows_up = [
        *TINY,
        "num_steps=3",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "rollout.reward=tests.restart_rewards:response_chars",
        "trainer.lr=1e30",
    ]
    supervisor = supervised([*blows_up, "--max-restarts", "2"], run_dir, err)
    assert finish(supervisor) == exitcodes.NON_FINITE, err.read_text()[-3000:]
    assert "non-finite loss" in err.read_text()
    assert restart_records(run_dir) == []


@pytest.mark.slow  # about 8 s
def test_sigterm_reaches_the_trainer_and_nothing_restarts(tmp_path: Path) -> None:
    run_dir, err = tmp_path / "run", tmp_path / "stderr"
    supervisor = supervised([*RUN, "num_steps=100", "--max-restarts", "2"], run_dir, err)
    trainer = running_trainer(supervisor, lambda: (run_dir / "metrics.jsonl").exists())
    supervisor.send_signal(signal.SIGTERM)
    assert finish(supervisor) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(trainer, 0)  # gone, and reaped
    assert restart_records(run_dir) == []


def test_max_restarts_is_refused_under_torchrun(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["train", *TINY, "--max-restarts", "1", "--run-dir", str(tmp_path / "run")]
    assert main(args) == exitcodes.BAD_INPUT
    err = capsys.readouterr().err
    assert "under torchrun" in err and "pass --max-restarts to torchrun" in err
    assert not (tmp_path / "run").exists()
