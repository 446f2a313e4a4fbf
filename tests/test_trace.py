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


def test_the_async_worker_traces_each_groups_stages_on_a_track_of_its_own(
    tmp_path: Path,
) -> None:
    import asyncio

    from tests.test_async_worker import FakeEngine, FakeSource, reward
    from verst.rollout.async_worker import RolloutWorker
    from verst.rollout.buffer import DataBuffer

    async def main() -> None:
        worker = RolloutWorker(
            FakeSource(2),
            DataBuffer(4),
            FakeEngine(manual=False, delay=lambda key: 0.002 * (key[0] + 1)),
            reward,
            n_samples_per_prompt=2,
            max_inflight=4,
        )
        async with worker:
            await worker.take(2, current_version=0)

    path = tmp_path / "trace.json"
    trace.start(path, "trainer rank 0")
    asyncio.run(asyncio.wait_for(main(), timeout=20))
    trace.stop()
    events = [e for e in json.loads(path.read_text()) if e["ph"] in "be"]
    by_group: dict[int, list[tuple[str, str, float]]] = {}
    for e in events:
        by_group.setdefault(e["id"], []).append((e["name"], e["ph"], e["ts"]))
    done = [g for g, marks in by_group.items() if ("group put", "e") in [m[:2] for m in marks]]
    assert len(done) >= 2  # the groups taken, each on its own track
    for group in done:
        marks = by_group[group]
        stages = [name for name, ph, _ in marks if ph == "b"]
        assert stages == ["group generate", "group reward", "group put"], marks
        times = [ts for _, _, ts in marks]
        assert times == sorted(times), marks  # one stage after the other
