"""Evaluation modes end to end through `verst train`: shared (in the step), external and fleet
(snapshots scored in the background, recorded at the step they measured); sets, pass@k."""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import pytest

from tests.test_loop import SMALL, records
from verst.cli import main
from verst.config import ConfigError, load_config
from verst.eval.scores import ks_reported, pass_at_k

NO_WARM = ["warm_start.enabled=false", "checkpoint.interval_steps=0"]


def eval_rows(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r.get("record") == "eval"]


def step_rows(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "record" not in r]


def test_pass_at_k_matches_the_closed_form() -> None:
    # n=4, c=1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6, pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    assert ks_reported(1) == [1] and ks_reported(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["eval.mode=fleet", "eval.interval_steps=2"], "eval.engine_devices"),
        (
            [
                "eval.mode=fleet",
                "eval.interval_steps=2",
                "eval.engine_devices=[cpu]",
                "eval.num_engines=0",
            ],
            "eval.num_engines",
        ),
        (["eval.mode=external", "eval.function=tests.eval_functions:slow"], "eval.interval_steps"),
        (["eval.mode=external", "eval.interval_steps=2"], "eval.function"),
        (
            ["eval.mode=external", "eval.interval_steps=2", "eval.function=tests.nowhere:fn"],
            "eval.function",
        ),
        (
            [
                "eval.mode=external",
                "eval.interval_steps=2",
                "eval.function=tests.eval_functions:nope",
            ],
            "eval.function",
        ),
        (["eval.function=tests.eval_functions:slow", "eval.interval_steps=2"], "eval.function"),
        (["eval.nice=20"], "eval.nice"),
        (["placement.engine_nice=-1"], "placement.engine_nice"),
    ],
)
def test_eval_mode_requirements_are_checked_at_config_time(
    overrides: list[str], field: str
) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_shared_sets_with_pass_at_k_are_valid_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sets = (
        "eval.sets=[{name: add, data: {task: addition, split: test, shuffle: false, "
        "max_prompts: 4}, n_samples: 4, temperature: 1.0, max_new_tokens: 4, reward: exact_match},"
        " {name: greedy, data: {task: addition, split: test, shuffle: false, max_prompts: 3},"
        " max_new_tokens: 4}]"
    )
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, *NO_WARM, sets, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    points = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in points] == [0, 2, 4]
    for row in points:
        assert row["eval/add/num_prompts"] == 4 and row["eval/greedy/num_prompts"] == 3
        assert {"eval/add/pass@1", "eval/add/pass@2", "eval/add/pass@4"} <= row.keys()
        assert row["eval/add/pass@1"] <= row["eval/add/pass@2"] <= row["eval/add/pass@4"]
        assert row["eval/add/pass@1"] == pytest.approx(row["eval/add/accuracy"])
        assert row["eval/mixed_version_ratio"] == 0
        assert row["eval/weight_version/mean"] == row["weight_version"]
        assert row["eval/lag_steps"] == 0 and row["eval/duration_s"] > 0
        assert not any(k.startswith("eval/skipped_") for k in row)

    # verst eval on the last checkpoint prints the greedy set's score the run logged for it
    config = tmp_path / "eval.yaml"
    config.write_text(sets.replace("eval.sets=", "eval:\n  sets: ") + "\n")
    capsys.readouterr()
    checkpoint = run_dir / "checkpoints" / "step_000004"
    assert main(["eval", str(checkpoint), str(config), "rollout.reward=exact_match"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "set",
        "num_prompts",
        "accuracy",
        "pass@1",
        "pass@2",
        "pass@4",
        "response_len_mean",
    ]
    greedy = next(line.split() for line in table if line.startswith("greedy"))
    assert greedy[1] == "3"
    assert float(greedy[2]) == pytest.approx(points[-1]["eval/greedy/accuracy"], abs=1e-3)
    assert main(["eval", str(tmp_path / "nowhere"), str(config)]) == 2


def test_external_points_are_recorded_at_the_step_they_measured(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        *SMALL,
        *NO_WARM,
        "num_steps=5",
        "eval.mode=external",
        "eval.function=tests.eval_functions:files_seen",
        "eval.keep_snapshots=1",
    ]
    assert main(["train", *overrides, "--run-dir", str(run_dir)]) == 0
    steps = {r["step"]: r for r in step_rows(run_dir)}
    evals = eval_rows(run_dir)
    assert [r["step"] for r in evals] == [0, 2, 4, 5]  # the last step too
    for row in evals:
        assert row["eval/step"] == row["step"]
        assert row["eval/weight_version"] == steps[row["step"]]["weight_version"]
        assert row["eval/version_seen"] == row["eval/weight_version"]
        assert row["eval/has_weights"] == 1 and row["eval/complete"] == 1
        assert row["eval/num_sets"] == 1
        # in a process of its own, below the trainer's CPU priority (eval.nice, default 10)
        assert row["eval/pid"] != os.getpid() and row["eval/pid"] == evals[0]["eval/pid"]
        assert row["eval/nice"] == min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)
        assert row["eval/lag_steps"] >= 0 and row["eval/duration_s"] >= 0
    # the last step's checkpoint is reused; the others were exported for their point
    assert ["eval/export_time_s" in r for r in evals] == [True, True, True, False]
    # only our own exports are collected (the newest kept), never a checkpoint
    assert sorted(p.name for p in (run_dir / "eval_snapshots").iterdir()) == ["step_000004"]
    assert (run_dir / "checkpoints" / "step_000005" / ".complete").is_file()


def test_external_skips_crashes_and_busy_never_stop_training(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        *SMALL,
        *NO_WARM,
        "num_steps=5",
        "eval.interval_steps=1",
        "eval.mode=external",
        "eval.function=tests.eval_functions:skips_odd_steps",
        "checkpoint.interval_steps=2",  # points at steps 2 and 4 reuse those checkpoints
    ]
    assert main(["train", *overrides, "--run-dir", str(run_dir)]) == 0
    evals = {r["step"]: r for r in eval_rows(run_dir)}
    assert sorted(evals) == [0, 1, 2, 3, 4, 5]
    assert evals[0]["eval/score"] == 0.0 and evals[4]["eval/score"] == 4.0
    assert evals[1]["eval/skipped_odd_step"] == 1 and "eval/score" not in evals[1]
    assert evals[2]["eval/skipped_crashed"] == 1 and "broke" in evals[2]["eval/skip_detail"]
    # the function's process died: that point crashed, the next ran in a new process
    assert evals[3]["eval/skipped_crashed"] == 1 and "died" in evals[3]["eval/skip_detail"]
    assert "eval/export_time_s" not in evals[4]  # the saved checkpoint was reused
    assert "eval/export_time_s" in evals[1]
    assert len(step_rows(run_dir)) == 6

    busy_dir = tmp_path / "busy"
    busy = [
        *SMALL,
        *NO_WARM,
        "num_steps=4",
        "eval.interval_steps=1",
        "eval.mode=external",
        "eval.function=tests.eval_functions:slow",
        "eval.max_in_flight=1",
        "eval.overflow=skip",
    ]
    assert main(["train", *busy, "--run-dir", str(busy_dir)]) == 0
    evals = {r["step"]: r for r in eval_rows(busy_dir)}
    assert sorted(evals) == [0, 1, 2, 3, 4]
    assert any("eval/skipped_busy" in r for r in evals.values())
    assert evals[4]["eval/score"] == 1.0  # never skipped on the last step
    assert evals[0]["eval/score"] == 1.0


ASYNC_ONE_ENGINE = [
    "mode=fully_async",
    "placement.engines=processes",
    "placement.mode=disaggregated",
    "placement.num_engines=1",
    "placement.engine_threads=1",
    "rollout.max_staleness=2",
]


def test_shared_eval_in_fully_async_mode_pauses_the_rollout(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    run_dir = tmp_path / "run"
    overrides = [*SMALL, *NO_WARM, *ASYNC_ONE_ENGINE, "eval.interval_steps=1"]
    assert main(["train", *overrides, "--run-dir", str(run_dir)]) == 0
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    # generation ran ahead of the trainer, yet every point measured its step's weights alone
    assert max(r["buffer/staleness_max"] for r in rows[1:]) >= 1
    for row in rows:
        assert row["eval/num_prompts"] == 8
        assert row["eval/mixed_version_ratio"] == 0
        assert row["eval/weight_version/mean"] == row["weight_version"]
        assert not any(k.startswith("eval/skipped_") for k in row)


class ServeNiceness(threading.Thread):
    """The niceness of every `verst serve` process this test process starts (`--parent-pid`
    names it), polled from /proc."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.values: set[int] = set()
        self.halt = threading.Event()

    def run(self) -> None:
        ours = ["serve", "--parent-pid", str(os.getpid())]
        while not self.halt.wait(0.2):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                    if all(arg in argv for arg in ours):
                        self.values.add(os.getpriority(os.PRIO_PROCESS, int(pid)))
                except OSError:
                    pass  # gone meanwhile

    def __enter__(self) -> ServeNiceness:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join()


def test_fleet_eval_pins_a_snapshot_on_its_own_engine_process(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    run_dir = tmp_path / "run"
    overrides = [
        *SMALL,
        *NO_WARM,
        "eval.mode=fleet",
        "eval.engine_devices=[cpu]",
        "eval.engine_threads=1",
        "eval.max_in_flight=1",
    ]
    with ServeNiceness() as seen:
        assert main(["train", *overrides, "--run-dir", str(run_dir)]) == 0
    # the eval engine (the only `verst serve` process here) ran below the trainer's priority
    assert seen.values == {min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)}
    steps = {r["step"]: r for r in step_rows(run_dir)}
    evals = eval_rows(run_dir)
    assert [r["step"] for r in evals] == [0, 2, 4]
    for row in evals:
        # valid: every sample came from the snapshot's version, which is the step's
        assert row["eval/weight_version"] == steps[row["step"]]["weight_version"]
        assert row["eval/weight_version/mean"] == row["eval/weight_version"]
        assert row["eval/mixed_version_ratio"] == 0
        assert row["eval/num_prompts"] == 8 and 0 <= row["eval/accuracy"] <= 1
        assert row["eval/duration_s"] > 0
        assert not any(k.startswith("eval/skipped_") for k in row)
    # fresh exports, but the last step's checkpoint, saved anyway, is reused
    assert ["eval/export_time_s" in r for r in evals] == [True, True, False]
    assert "eval/accuracy" not in steps[2]  # the trainer never waited for the score
