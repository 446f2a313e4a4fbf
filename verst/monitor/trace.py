"""Chrome-trace JSON of a run's phases (`monitor.trace: true`), viewable in Perfetto.

One `Tracer` a process, installed with `start` and reached through the module functions, so
any part (the loop's `PhaseTimer`, the weight-sync protocol, an in-process engine) marks a span
in one line and pays one `None` check when tracing is off. Events are "complete" events
(`ph: X`, microseconds) on the thread that ran them, under the process's pid with a
`process_name`; timestamps are wall-clock, so the processes of a run (ranks, a resumed attempt)
line up on one timeline.

The file is the JSON array format, written as the run goes (`flush`, once a step): while it runs
the closing `]` is missing, which Perfetto accepts; `stop` closes it. A resumed run appends to
the same file: the events of every earlier attempt are kept, a partly written last line of a
crashed one is dropped.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from verst.rundir import writing

TRACE_FILE = "trace.json"


def trace_file(rank: int) -> str:
    """Rank 0's trace is `trace.json`; another rank's `trace.rank<N>.json` (no rank waits on
    another to write)."""
    return TRACE_FILE if rank == 0 else f"trace.rank{rank}.json"


class Tracer:
    def __init__(self, path: Path, process_name: str) -> None:
        self.path = path
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._threads: set[int] = set()
        # perf_counter for durations, shifted once onto the wall clock for timestamps
        self._offset_ns = time.time_ns() - time.perf_counter_ns()
        kept = _complete_events(path) if path.exists() else []
        with writing(path):
            self._file = path.open("w")
            self._file.write("[\n" + "".join(f"{line},\n" for line in kept))
        self._pending.append(_metadata("process_name", self.pid, 0, process_name))

    def complete(
        self, name: str, cat: str, start_ns: int, end_ns: int, args: dict, span_id: int | None
    ) -> None:
        """A span that began at `start_ns` and ended at `end_ns` (`time.perf_counter_ns`) on
        this thread; with `span_id`, an async span (spans that overlap on one thread, such as
        the groups a rollout worker generates at once, each on a track of its own)."""
        tid = threading.get_native_id()
        event = {"name": name, "cat": cat, "pid": self.pid, "tid": tid}
        start_us = (start_ns + self._offset_ns) / 1000
        if args:
            event["args"] = args
        if span_id is None:
            events = [event | {"ph": "X", "ts": start_us, "dur": (end_ns - start_ns) / 1000}]
        else:
            end_us = (end_ns + self._offset_ns) / 1000
            event["id"] = span_id
            events = [event | {"ph": "b", "ts": start_us}, event | {"ph": "e", "ts": end_us}]
        with self._lock:
            if tid not in self._threads:
                self._threads.add(tid)
                thread = threading.current_thread().name
                self._pending.append(_metadata("thread_name", self.pid, tid, thread))
            self._pending.extend(events)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            with writing(self.path):
                self._file.write("".join(f"{json.dumps(e)},\n" for e in pending))
                self._file.flush()

    def close(self) -> None:
        self.flush()
        with writing(self.path):
            # a trailing metadata event closes the array without a dangling comma
            self._file.write(json.dumps(_metadata("process_labels", self.pid, 0, "verst")))
            self._file.write("\n]\n")
            self._file.close()


def _metadata(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    key = "labels" if kind == "process_labels" else "name"
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {key: name}}


def _complete_events(path: Path) -> list[str]:
    """The whole event lines of an earlier attempt's trace (closed or cut off mid-line)."""
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip().removesuffix(",")
        if line in ("[", "]", ""):
            continue
        try:
            json.loads(line)
        except ValueError:
            continue
        kept.append(line)
    return kept


_active: Tracer | None = None


def start(path: Path, process_name: str) -> Tracer:
    global _active
    _active = Tracer(path, process_name)
    return _active


def stop() -> None:
    global _active
    tracer, _active = _active, None
    if tracer is not None:
        tracer.close()


def flush() -> None:
    if _active is not None:
        _active.flush()


def now() -> int | None:
    """The start of a span to `complete` later, or None when nothing traces."""
    return time.perf_counter_ns() if _active is not None else None


def complete(
    name: str, start_ns: int | None, *, cat: str, span_id: int | None = None, **args: Any
) -> None:
    """End a span begun with `now()` (nothing when it returned None); `span_id`: an async span
    (`Tracer.complete`)."""
    tracer = _active
    if tracer is not None and start_ns is not None:
        tracer.complete(name, cat, start_ns, time.perf_counter_ns(), args, span_id)


@contextmanager
def span(name: str, *, cat: str, **args: Any) -> Iterator[None]:
    started = now()
    try:
        yield
    finally:
        complete(name, started, cat=cat, **args)
