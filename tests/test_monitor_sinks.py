"""Metric sinks and traces through a real `verst train`: TensorBoard (read back with its
EventAccumulator), W&B offline (its run files), MLflow (a local file store, read with its
client), and `trace.json`; a resume continues each sink's run; sinks that fail."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_loop import SMALL, records
from tests.wandb_offline import read_offline_run
from verst.cli import main
from verst.config import ConfigError, load_config
from verst.monitor.config import MonitorConfig
from verst.monitor.sinks import MlflowSink, SinkSet, TensorBoardSink, mlflow_name, scalars

SINKS = ["monitor.sinks=[jsonl,tensorboard,wandb,mlflow]", "monitor.trace=true"]
PLAIN = [a for a in SMALL if not a.startswith("warm_start")] + ["num_steps=3"]


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """W&B offline and MLflow's file store, every W&B file under a temporary directory."""
    home = tmp_path_factory.mktemp("sink_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            patch.setenv(name, str(home / name.lower()))
        yield home


@pytest.fixture(scope="module")
def resumed_run(offline_env: Path) -> tuple[Path, str]:
    """Two steps, then a resume to the third, every sink on and traced; (run dir, console)."""
    run_dir = offline_env / "run"
    uri = f"monitor.mlflow_tracking_uri=file:{offline_env / 'mlruns'}"
    console = io.StringIO()
    with contextlib.redirect_stderr(console):
        args = ["train", *PLAIN, *SINKS, uri]
        assert main([*args, "num_steps=2", "--run-dir", str(run_dir)]) == 0
        assert main([*args, "--run-dir", str(run_dir), "--resume"]) == 0
    return run_dir, console.getvalue()


def numbers_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    return {row["step"]: scalars(row) for row in records(run_dir)}


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


def test_tensorboard_holds_every_key_of_every_step_once(resumed_run: tuple[Path, str]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = resumed_run
    expected = numbers_by_step(run_dir)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {key for row in expected.values() for key in row}
    for tag in tags:
        points = events.Scalars(tag)
        steps = [p.step for p in points]
        assert steps == sorted(set(steps)), tag  # the resumed attempt continued, no repeats
        assert steps == [s for s, row in expected.items() if tag in row], tag
        assert all(same(p.value, expected[p.step][tag]) for p in points), tag
    assert len(list((run_dir / "tensorboard").iterdir())) == 2  # one event file an attempt


def test_wandb_resumes_the_same_run_with_the_same_keys(resumed_run: tuple[Path, str]) -> None:
    run_dir, _ = resumed_run
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # the first attempt and the resumed one
    expected = numbers_by_step(run_dir)
    seen: dict[int, dict] = {}
    for file in files:
        file_id, rows = read_offline_run(file)
        assert file_id == run_id
        for row in rows:
            seen[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    assert sorted(seen) == sorted(expected) == [0, 1, 2, 3]
    for step, row in expected.items():
        assert set(seen[step]) == set(row), step
        assert all(same(float(seen[step][k]), v) for k, v in row.items()), step


def test_mlflow_resumes_the_same_run_with_the_same_keys(
    resumed_run: tuple[Path, str], offline_env: Path
) -> None:
    from mlflow import MlflowClient

    run_dir, _ = resumed_run
    client = MlflowClient(tracking_uri=f"file:{offline_env / 'mlruns'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["rollout.n_samples_per_prompt"] == "4"
    expected = numbers_by_step(run_dir)
    assert set(run.data.metrics) == {mlflow_name(key) for row in expected.values() for key in row}
    assert "eval/pass_at_1" in run.data.metrics  # MLflow refuses "@" in names
    for key in ("rollout/reward_mean", "train/loss", "perf/train_forward_time_s"):
        history = client.get_metric_history(run.info.run_id, key)
        want = [(s, pytest.approx(row[key])) for s, row in expected.items() if key in row]
        assert sorted((m.step, m.value) for m in history) == want
    [experiment] = [e for e in client.search_experiments() if e.name == "verst"]
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_trace_holds_every_phase_of_both_attempts(resumed_run: tuple[Path, str]) -> None:
    run_dir, _ = resumed_run
    events = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    phases = {"rollout", "reward", "advantages", "train", "sync", "eval", "checkpoint"}
    assert phases | {"train_forward", "train_backward", "train_optimizer"} <= names
    assert "engine step" in names  # the embedded engine runs in the trainer's process
    assert sorted(e["args"]["step"] for e in spans if e["name"] == "train") == [1, 2, 3]
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    processes = [e for e in events if e["name"] == "process_name"]
    assert processes and all(e["args"]["name"] == "trainer rank 0" for e in processes)
    assert {e["pid"] for e in spans} == {e["pid"] for e in processes}
    # a sub-phase lies inside its phase
    train = {e["args"]["step"]: e for e in spans if e["name"] == "train"}
    for e in (e for e in spans if e["name"].startswith("train_")):
        outer = train[e["args"]["step"]]
        assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1


def test_every_step_times_its_phases_and_the_console_shows_pace(
    resumed_run: tuple[Path, str],
) -> None:
    run_dir, console = resumed_run
    for row in records(run_dir)[1:]:
        for phase in ("train_forward", "train_backward", "train_optimizer", "sync_send"):
            assert row[f"perf/{phase}_time_s"] >= 0, phase
        tokens = row["rollout/response_tokens"]
        assert tokens == row["rollout/response_len_mean"] * row["rollout/num_samples"]
        assert row["perf/tokens_per_s"] == pytest.approx(tokens / row["perf/step_time_s"])
    lines = [line for line in console.splitlines() if line.startswith("step 2 |")]
    assert lines and "tok/s" in lines[0] and "eta 0:00:0" in lines[0], console
    assert "monitor: wandb run" in console and "monitor: mlflow run" in console


def test_a_sink_failing_mid_run_warns_once_and_the_others_go_on(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        store = tmp_path / "mlruns"
        cfg = MonitorConfig(mlflow_tracking_uri=f"file:{store}")
        warnings: list[str] = []
        mlflow = MlflowSink(cfg, tmp_path, resume=False, config={"seed": 0})
        sinks = SinkSet([TensorBoardSink(tmp_path, 0), mlflow], warnings.append)
        sinks.log({"step": 0, "loss": 1.0})
        for run_dir in store.glob(f"*/{mlflow.run_id}"):
            shutil.rmtree(run_dir)  # the tracking store lost the run
        for step in (1, 2, 3):
            sinks.log({"step": step, "loss": 1.0 / (step + 1), "note": "text is not a metric"})
        sinks.close(failed=False)
    assert len(warnings) == 3, warnings
    assert warnings[0].startswith("monitor.sinks: mlflow failed at step 1 (")
    assert "failed to close" in warnings[1]
    assert warnings[2] == "monitor.sinks: mlflow lost 3 of 4 steps' metrics"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [p.step for p in events.Scalars("loss")] == [0, 1, 2, 3]
    assert events.Tags()["scalars"] == ["loss"]


def test_a_sink_that_cannot_start_stops_the_run_naming_it(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        code = main(
            [
                "train",
                *PLAIN,
                "monitor.sinks=[jsonl,mlflow]",
                f"monitor.mlflow_tracking_uri=file:{blocker / 'mlruns'}",
                "--run-dir",
                str(tmp_path / "run"),
            ]
        )
    assert code == 2
    assert "verst: error: monitor.sinks: mlflow failed to start: " in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("monitor.sinks=[tensorboard]", "monitor.sinks: must include jsonl"),
        ("monitor.sinks=[jsonl,jsonl]", "monitor.sinks: names a sink twice"),
        ("monitor.sinks=[jsonl,comet]", "monitor.sinks.1: Input should be"),
    ],
)
def test_bad_sink_lists_are_refused_naming_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(None, [override])


def test_serving_engines_time_each_sync_step_and_trace_their_engine_steps(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    args = [*PLAIN, "num_steps=2", "placement.engines=in_process", "monitor.trace=true"]
    assert main(["train", *args, "--run-dir", str(run_dir)]) == 0
    for row in records(run_dir)[1:]:
        steps = ("pause", "flush", "send", "set_version", "continue", "confirm")
        times = [row[f"perf/sync_{s}_time_s"] for s in steps]
        assert all(t >= 0 for t in times)
        assert sum(times) <= row["perf/sync_time_s"]
    events = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in events if e["ph"] == "X"]
    assert {"sync pause", "sync send", "sync continue"} <= {e["name"] for e in spans}
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    engine_threads = {threads[e["tid"]] for e in spans if e["name"] == "engine step"}
    assert engine_threads and "MainThread" not in engine_threads  # the engines' own threads
    assert len({e["pid"] for e in events}) == 1


def test_plot_draws_a_real_run(resumed_run: tuple[Path, str], tmp_path: Path, capsys) -> None:
    run_dir, _ = resumed_run
    out = tmp_path / "run.png"
    assert main(["plot", str(run_dir), "-o", str(out)]) == 0
    assert out.stat().st_size > 20_000
    skipped = capsys.readouterr().err
    # the tiny run has every panel's metrics: only a key absent from the objective is missing
    assert "no run has data" not in skipped, skipped
