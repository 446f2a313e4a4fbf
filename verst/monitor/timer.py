"""One timer for the phases of a step: `with timer("train"): ...` records
`perf/train_time_s` (and, with `monitor.trace`, a span in `trace.json`), so each phase of the
loop is one visible line and times itself.

On CUDA (`device`) a phase is timed with CUDA events on the current stream, read when the
metrics are: kernels run after the host has moved on, so host time would put a backward's time
into whatever phase next waits on the GPU, and reading the events at the end of the step adds
no wait of its own (the step's metrics already wait for the GPU)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from verst.monitor import trace


class PhaseTimer:
    """Seconds per phase of one step; a phase entered twice adds up."""

    def __init__(
        self,
        *,
        device: Any = None,
        step: int | None = None,
        cat: str = "step",
        memory_device: Any = None,
    ) -> None:
        """`device`: a torch.device; on CUDA, phases are timed on the GPU. `step`, `cat`: what
        the trace's spans are labelled with. `memory_device` (CUDA): each phase's peak of
        allocated device memory, `perf/<phase>_peak_memory_gb`."""
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self._memory = memory_device if getattr(memory_device, "type", None) == "cuda" else None
        self._cuda = device is not None and device.type == "cuda"
        self._events: list[tuple[str, Any, Any]] = []
        self._trace_args = {} if step is None else {"step": step}
        self._cat = cat

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self._cuda:
            import torch

            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
        if self._memory is not None:
            import torch

            torch.cuda.reset_peak_memory_stats(self._memory)
        started = time.perf_counter()
        traced = trace.now()
        try:
            yield
        finally:
            trace.complete(phase, traced, cat=self._cat, **self._trace_args)
            if self._memory is not None:
                peak = torch.cuda.max_memory_allocated(self._memory)
                self.peak_bytes[phase] = max(self.peak_bytes.get(phase, 0), peak)
            if self._cuda:
                end.record()
                self._events.append((phase, begin, end))
            else:
                self._add(phase, time.perf_counter() - started)

    def _add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def metrics(
        self, *, step_phases: tuple[str, ...] | None = None, tokens: float | None = None
    ) -> dict[str, float]:
        """`perf/<phase>_time_s` for every phase timed; with `step_phases`, `perf/step_time_s`:
        their sum (the step proper; evaluation and checkpoints are reported apart), and with
        `tokens` (the step's response tokens) `perf/tokens_per_s` over that time."""
        for phase, begin, end in self._events:
            end.synchronize()
            self._add(phase, begin.elapsed_time(end) / 1000)
        self._events = []
        metrics = {f"perf/{phase}_time_s": s for phase, s in self.seconds.items()}
        for phase, peak in self.peak_bytes.items():
            metrics[f"perf/{phase}_peak_memory_gb"] = peak / 1e9
        if step_phases is not None:
            step_s = sum(self.seconds.get(p, 0.0) for p in step_phases)
            metrics["perf/step_time_s"] = step_s
            if tokens is not None and step_s > 0:
                metrics["perf/tokens_per_s"] = tokens / step_s
        return metrics
