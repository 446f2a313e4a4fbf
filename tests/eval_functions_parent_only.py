"""An `eval.function` whose module imports in the trainer's process but not in the process
the function runs in (a dependency missing there, say)."""

from __future__ import annotations

import multiprocessing

from verst.plugins import EvalRequest

if multiprocessing.parent_process() is not None:
    raise ImportError("this module does not import in a child process")


def score(checkpoint_dir: str, request: EvalRequest) -> dict[str, float]:
    return {"score": 1.0}
