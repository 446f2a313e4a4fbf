"""A run directory that cannot be written stops `verst train` with one line naming the path and
the cause (exit code 3), keeping the last good checkpoint; a resume removes and reports the
partial directories of saves that never finished.

A full disk is real where it can be: `/dev/full` fails every write with ENOSPC, so a run file
linked to it is a full disk for that file. A checkpoint's files are created fresh in a new
directory, so there the write is redirected to `/dev/full` at the one OS-facing call
(`torch.save`'s destination); every verst component is real.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from verst import exitcodes
from verst.cli import main
from verst.config import load_config
from verst.loop import train
from verst.rundir import RunDirError, run_dir_error, writing
from verst.train.checkpoint import list_checkpoints, load_checkpoint

TINY = [
    "trainer.device=cpu",
    "num_threads=1",
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 64, max_position_embeddings: 32}",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=2",
    "eval.interval_steps=0",
    "eval.data.max_prompts=2",
    "eval.max_new_tokens=2",
    "checkpoint.interval_steps=1",
]

needs_dev_full = pytest.mark.skipif(
    not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)),
    reason="needs /dev/full, the character device whose writes fail with ENOSPC",
)


def steps(run_dir: Path) -> list[int]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def error_line(err: str) -> str:
    """The command's last line; the run's own output comes before it, and no traceback."""
    assert "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


def test_a_run_dir_under_a_regular_file_stops_before_any_model_is_built(
    tmp_path: Path, capsys
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    run_dir = blocker / "run"
    assert main(["train", *TINY, "num_steps=1", "--run-dir", str(run_dir)]) == exitcodes.RUN_DIR
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line: nothing was built before the check
    assert err == f"verst: error: cannot write {run_dir}: Not a directory (ENOTDIR)\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_a_read_only_run_dir_stops_with_one_line(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o500)
    try:
        code = main(["train", *TINY, "num_steps=1", "--run-dir", str(run_dir)])
    finally:
        run_dir.chmod(0o700)
    assert code == exitcodes.RUN_DIR
    assert "(EACCES)" in capsys.readouterr().err


@needs_dev_full
def test_a_full_disk_under_config_yaml_stops_the_cli_with_one_line(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").symlink_to("/dev/full")
    assert main(["train", *TINY, "num_steps=1", "--run-dir", str(run_dir)]) == exitcodes.RUN_DIR
    line = error_line(capsys.readouterr().err)
    path = run_dir / "config.yaml"
    assert line == f"verst: error: cannot write {path}: No space left on device (ENOSPC)"


@needs_dev_full
def test_a_full_disk_under_metrics_jsonl_stops_the_run(tmp_path: Path) -> None:
    """No record is dropped quietly: the first step's write fails, and the run stops there."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(RunDirError) as caught:
        train(load_config(None, [*TINY, "num_steps=2"]), run_dir)
    assert caught.value.errno == errno.ENOSPC
    assert str(caught.value) == (
        f"cannot write {run_dir / 'metrics.jsonl'}: No space left on device (ENOSPC)"
    )
    assert list_checkpoints(run_dir) == []  # it stopped at step 0, before any RL step


@needs_dev_full
def test_a_full_disk_mid_checkpoint_keeps_the_previous_one_and_resume_continues(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    real_save = torch.save

    def save_onto_a_full_disk(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if "step_000002.partial" in str(getattr(f, "name", f)):
            with open("/dev/full", "wb") as full:
                return real_save(obj, full, *args, **kwargs)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_onto_a_full_disk)
    run_dir = tmp_path / "run"
    args = ["train", *TINY, "num_steps=3", "--run-dir", str(run_dir)]
    assert main(args) == exitcodes.RUN_DIR
    checkpoint = run_dir / "checkpoints" / "step_000002"
    line = error_line(capsys.readouterr().err)
    assert line == f"verst: error: cannot write {checkpoint}: No space left on device (ENOSPC)"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]
    load_checkpoint(list_checkpoints(run_dir)[-1])  # the previous checkpoint is whole
    assert steps(run_dir) == [0, 1]  # step 2's record waits for its checkpoint

    monkeypatch.setattr(torch, "save", real_save)  # space freed: the run resumes
    assert main([*args, "--resume"]) == 0
    assert steps(run_dir) == [0, 1, 2, 3]


def test_a_safetensors_write_error_names_its_path_and_errno(tmp_path: Path) -> None:
    """safetensors reports a failed write in its own error type; its errno is still found."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(RunDirError) as caught, writing(tmp_path / "checkpoint"):
        save_file({"w": torch.zeros(4)}, str(blocker / "model.safetensors"))
    assert caught.value.errno == errno.ENOTDIR
    assert str(caught.value) == f"cannot write {tmp_path / 'checkpoint'}: Not a directory (ENOTDIR)"


def test_resume_removes_and_reports_a_partial_checkpoint(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "num_steps=1", "--run-dir", str(run_dir)]) == 0
    stale = run_dir / "checkpoints" / "step_000002.partial"
    stale.mkdir()
    # a save killed while writing its last file: the state file exists, truncated
    (stale / "trainer_state.pt").write_bytes(b"PK\x03\x04 half a zip")
    capsys.readouterr()
    assert main(["train", *TINY, "num_steps=2", "--run-dir", str(run_dir), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"removed {stale}: a checkpoint whose save never finished" in err
    assert not stale.exists()
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000001", "step_000002"]


def test_errors_from_other_writers_are_attributed_by_their_path(tmp_path: Path) -> None:
    """What `verst train` does with an OSError that reaches it from a writer that names no run
    file itself (engine files, weight snapshots, ledgers): real errors of the operating system."""
    run_dir = tmp_path / "run"
    (run_dir / "engine_init").mkdir(parents=True)
    (run_dir / "engine_init" / "config.json").write_text("{}")
    inside = run_dir / "engine_init" / "config.json" / "model.safetensors"
    with pytest.raises(OSError) as caught:
        inside.write_text("x")
    converted = run_dir_error(caught.value, run_dir)
    assert str(converted) == f"cannot write {inside}: Not a directory (ENOTDIR)"

    outside = tmp_path / "data.jsonl"
    with pytest.raises(OSError) as caught:
        outside.read_text()
    assert run_dir_error(caught.value, run_dir) is None  # a missing input is not the run dir's


@needs_dev_full
def test_a_full_disk_that_names_no_file_is_the_run_dirs(tmp_path: Path) -> None:
    """A buffered write fails at its flush, and the OSError carries no file name."""
    with pytest.raises(OSError) as caught, open("/dev/full", "w") as f:
        f.write("a record\n")
    assert caught.value.filename is None
    assert str(run_dir_error(caught.value, tmp_path)) == (
        f"cannot write under {tmp_path}: No space left on device (ENOSPC)"
    )
