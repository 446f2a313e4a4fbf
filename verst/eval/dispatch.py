"""Fire-and-forget evaluations: a thread that runs them one at a time, at most N pending.

`reserve(last=...)` takes a place for one more evaluation, or says there is none: with
`overflow: backpressure` it waits for one (the trainer's step waits), with `skip` it returns
False at once, except for the last point of a run, which always waits. `submit(job)` hands the
reserved place its job, a function that returns the point's record and never raises (it turns
its own failures into skip records). `finished()` returns the records of the evaluations that
have ended since the last call; `drain()` waits for every pending one.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Job = Callable[[], dict[str, Any]]


class Dispatcher:
    def __init__(self, max_in_flight: int, overflow: str) -> None:
        self.max_in_flight = max_in_flight
        self.overflow = overflow
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0  # reserved, queued or running
        self._done: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._serve, name="verst-eval", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def reserve(self, *, last: bool) -> bool:
        with self._cond:
            if self._pending >= self.max_in_flight and self.overflow == "skip" and not last:
                return False
            self._cond.wait_for(lambda: self._pending < self.max_in_flight)
            self._pending += 1
            return True

    def submit(self, job: Job) -> None:
        """Run `job` on the evaluation thread, in a place `reserve` took."""
        self._jobs.put(job)

    def cancel(self) -> None:
        """Give back a place `reserve` took, with no job for it."""
        self._finish(None)

    def record(self, record: dict[str, Any]) -> None:
        """A record of a point that needed no job (skipped before it started)."""
        with self._cond:
            self._done.append(record)

    def finished(self) -> list[dict[str, Any]]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def close(self, *, drain: bool) -> None:
        if drain:
            self.drain()
        self._jobs.put(None)
        self._thread.join(timeout=None if drain else 5.0)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                record = job()
            except BaseException:  # a job must not raise; if one does, the thread goes on
                log.exception("an evaluation raised; its point is lost")
                record = None
            self._finish(record)

    def _finish(self, record: dict[str, Any] | None) -> None:
        with self._cond:
            if record is not None:
                self._done.append(record)
            self._pending -= 1
            self._cond.notify_all()
