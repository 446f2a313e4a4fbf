"""The weights a snapshot evaluation measures: a directory an engine or a user function loads.

A point at step s reads the step's checkpoint when one is saved at s (the eval and checkpoint
intervals line up), waiting for its `.complete` marker; otherwise the trainer exports the
weights now to `run_dir/eval_snapshots/step_<s>/` (a collective: `PolicyModels.weights_writer`),
marked complete once written. Only those exports are ever removed (`collect_garbage`), never a
checkpoint; the newest `eval.keep_snapshots` of them whose evaluation has ended are kept.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from verst import distributed
from verst.rundir import writing
from verst.train.checkpoint import COMPLETE_MARKER

SNAPSHOT_ROOT = "eval_snapshots"


class SnapshotMissing(Exception):  # noqa: N818 (a skip, not an error of the run)
    """A checkpoint to reuse never became complete (or was removed)."""


def snapshot_dir(run_dir: Path, step: int) -> Path:
    return run_dir / SNAPSHOT_ROOT / f"step_{step:06d}"


def export_snapshot(
    run_dir: Path, step: int, policy: Any, tokenizer: PreTrainedTokenizerBase
) -> Path:
    """Write the policy's weights now as an HF directory (collective; rank 0 writes)."""
    out = snapshot_dir(run_dir, step)
    save = policy.weights_writer()
    if distributed.rank() == 0:
        with writing(out):
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            save(out)
            tokenizer.save_pretrained(out)
            (out / COMPLETE_MARKER).touch()
    distributed.barrier()
    return out


def wait_complete(path: Path, timeout_s: float) -> Path:
    """`path` once it holds its `.complete` marker; `SnapshotMissing` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (path / COMPLETE_MARKER).is_file():
        if time.monotonic() > deadline:
            raise SnapshotMissing(f"{path} has no {COMPLETE_MARKER} after {timeout_s:.0f} s")
        time.sleep(0.05)
    return path


def collect_garbage(run_dir: Path, keep: int, busy: set[Path]) -> list[Path]:
    """Remove our own exports but the newest `keep` and those still to be evaluated (`busy`)."""
    root = run_dir / SNAPSHOT_ROOT
    if not root.is_dir():
        return []
    exports = sorted(p for p in root.glob("step_*") if p.is_dir())
    removed = [p for p in exports[:-keep] if p not in busy]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
