"""`eval.function`s for tests of `eval.mode: external` (real functions a run imports)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from verst.plugins import EvalRequest, EvalSkip


def files_seen(checkpoint_dir: str, request: EvalRequest) -> dict[str, float]:
    """Scores that say what the function was given: a whole HF snapshot of the step."""
    path = Path(checkpoint_dir)
    return {
        "has_weights": float((path / "model.safetensors").is_file()),
        "complete": float((path / ".complete").is_file()),
        "version_seen": float(request.weight_version),
        "num_sets": float(len(request.sets)),
        "pid": float(os.getpid()),
        "nice": float(os.getpriority(os.PRIO_PROCESS, 0)),
    }


def slow(checkpoint_dir: str, request: EvalRequest) -> dict[str, float]:
    time.sleep(1.5)
    return {"score": 1.0}


def skips_odd_steps(checkpoint_dir: str, request: EvalRequest) -> dict[str, float]:
    if request.step % 2 and request.step != 3:
        raise EvalSkip("odd_step")
    if request.step == 2:
        raise RuntimeError("the scorer broke")
    if request.step == 3:
        os._exit(3)  # the function's process dies; the next point starts another
    return {"score": float(request.step)}
