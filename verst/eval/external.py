"""`eval.mode: external`: the user's `evaluate_checkpoint(checkpoint_dir, request) -> scores`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verst.plugins import CheckpointEvalFunction, EvalRequest, load_plugin


class ExternalScorer:
    """Calls `eval.function` on a snapshot; its scores come back as `eval/<name>` metrics."""

    def __init__(self, path: str, sets: list[dict[str, Any]]) -> None:
        self.fn = load_plugin(path, CheckpointEvalFunction, field="eval.function")
        self.path = path
        self.sets = sets

    def __call__(self, checkpoint_dir: Path, step: int, version: int) -> dict[str, float]:
        scores = self.fn(str(checkpoint_dir), EvalRequest(step, version, self.sets))
        if not isinstance(scores, Mapping):
            raise TypeError(
                f"eval.function {self.path} returned {type(scores).__name__}, not a dict"
            )
        metrics = {}
        for name, value in scores.items():
            number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not number or not math.isfinite(value):
                raise TypeError(
                    f"eval.function {self.path} returned {name}={value!r}, not a finite number"
                )
            metrics[name if name.startswith("eval/") else f"eval/{name}"] = float(value)
        return metrics
