"""The phase timer: one context manager a phase, times summed per phase, the step total."""

from __future__ import annotations

import time

import pytest

from verst.monitor.timer import PhaseTimer


def test_phases_add_up_and_the_step_counts_only_its_own_phases() -> None:
    timer = PhaseTimer()
    with timer("rollout"):
        time.sleep(0.02)
    with timer("train"):
        time.sleep(0.01)
    with timer("train"):  # a phase entered twice adds up
        time.sleep(0.01)
    with timer("eval"):
        time.sleep(0.01)
    metrics = timer.metrics(step_phases=("rollout", "train", "sync"))
    assert set(metrics) == {
        "perf/rollout_time_s",
        "perf/train_time_s",
        "perf/eval_time_s",
        "perf/step_time_s",
    }
    assert metrics["perf/train_time_s"] >= 0.02
    assert metrics["perf/step_time_s"] == pytest.approx(
        metrics["perf/rollout_time_s"] + metrics["perf/train_time_s"]
    )


def test_a_phase_that_raises_is_still_timed() -> None:
    timer = PhaseTimer()
    with pytest.raises(RuntimeError), timer("sync"):
        raise RuntimeError("engine down")
    assert "perf/sync_time_s" in timer.metrics(step_phases=("sync",))


def test_the_time_left_follows_the_recent_pace_not_the_start() -> None:
    from verst.monitor.metrics import Pace, format_duration

    pace = Pace(total_steps=10)
    pace.mark(0)
    time.sleep(0.05)  # the warm start: not a step's pace
    pace.mark(0)
    assert pace.eta_s() is None
    for step in (1, 2):
        time.sleep(0.01)
        pace.mark(step)
    eta = pace.eta_s()
    # 8 steps of 10 ms or a little more; counting the warm start would give >= 0.28 s
    assert eta is not None and 0.08 <= eta < 0.25
    assert format_duration(3725.4) == "1:02:05"
