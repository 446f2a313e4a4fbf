"""The trace writer: Chrome-trace JSON that parses when closed, and that a resumed attempt
continues after a crash cut its last line."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from verst.monitor import trace


def test_spans_of_threads_and_async_spans_and_a_resume_after_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace.start(path, "trainer rank 0")
    with trace.span("rollout", cat="step", step=1):
        time.sleep(0.002)
    worker = threading.Thread(target=lambda: trace.complete("engine step", trace.now(), cat="e"))
    worker.start()
    worker.join()
    started = trace.now()
    trace.complete("group generate", started, cat="rollout", span_id=7, group=7)
    trace.flush()
    # while the run goes on the array is open: Perfetto reads it, json does not
    assert path.read_text().rstrip().endswith(",")
    trace.stop()
    events = json.loads(path.read_text())
    rollout = next(e for e in events if e["name"] == "rollout")
    assert rollout["ph"] == "X" and rollout["dur"] >= 2000 and rollout["args"] == {"step": 1}
    threads = {e["tid"] for e in events if e["name"] == "thread_name"}
    assert len(threads) == 2  # the main thread and the worker, each named
    assert [e["ph"] for e in events if e["name"] == "group generate"] == ["b", "e"]
    # an attempt that crashed mid-line, then a resumed one appending
    path.write_text(path.read_text().removesuffix("\n]\n") + ',\n{"name": "cut')
    trace.start(path, "trainer rank 0")
    with trace.span("train", cat="step", step=2):
        pass
    trace.stop()
    names = [e["name"] for e in json.loads(path.read_text())]
    assert names.count("rollout") == 1 and names.count("train") == 1
    assert names.count("process_name") == 2  # one per attempt


def test_nothing_is_recorded_when_tracing_is_off() -> None:
    assert trace.now() is None
    with trace.span("rollout", cat="step"):
        pass
    trace.complete("engine step", None, cat="engine")
    trace.flush()
    trace.stop()
