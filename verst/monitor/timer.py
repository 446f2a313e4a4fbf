"""One timer for the phases of a step: `with timer("train"): ...` records
`perf/train_time_s`, so each phase of the loop is one visible line and times itself."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """Seconds per phase of one step; a phase entered twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed

    def metrics(self, *, step_phases: tuple[str, ...]) -> dict[str, float]:
        """`perf/<phase>_time_s` for every phase timed, and `perf/step_time_s`: the sum of
        `step_phases` (the step proper; evaluation and checkpoints are reported apart)."""
        metrics = {f"perf/{phase}_time_s": s for phase, s in self.seconds.items()}
        metrics["perf/step_time_s"] = sum(self.seconds.get(p, 0.0) for p in step_phases)
        return metrics
