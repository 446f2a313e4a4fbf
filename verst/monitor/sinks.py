"""Metric sinks besides `metrics.jsonl`: TensorBoard, Weights & Biases, MLflow (`monitor.sinks`).

Every sink gets the same keys: each record's numbers (text values such as an advisory stay in
`metrics.jsonl` and on the console), at the record's `step`. A resumed run continues the same
sink runs: TensorBoard writes on in `RUN_DIR/tensorboard` and hides the steps after the
checkpoint resumed from (`purge_step`), as `metrics.jsonl` is trimmed to it; the W&B and MLflow
run ids are kept in the run directory (`wandb_run_id`, `mlflow_run_id`) and the same runs go on.

A sink that cannot start (its package missing, a tracking server refusing) stops the run at start
with a `SinkError` naming it. One that fails mid-run is reported once and kept, so a passing
outage costs only its steps; `SinkSet.close` says how many writes each sink lost.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from verst.monitor.config import MonitorConfig
from verst.rundir import writing

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
MLFLOW_ID_FILE = "mlflow_run_id"
MLFLOW_BATCH = 1000  # MLflow's limit on the metrics of one log_batch
MLFLOW_PARAMS_BATCH = 100  # and on its params
MLFLOW_PARAM_CHARS = 500  # the longest param value older MLflow servers accept


class SinkError(ValueError):
    """A metric sink could not start; the message names it."""


class Sink(Protocol):
    name: str

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self, *, failed: bool) -> None: ...

    def describe(self) -> str:
        """One line: where this sink's run can be seen."""
        ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record, as floats, without its `step`."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float)
    }


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys and text values (MLflow params), each value cut to what
    every MLflow store takes (the whole config is `RUN_DIR/config.yaml`)."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= flat_config(value, f"{prefix}{key}.")
        else:
            text = str(value)
            cut = len(text) > MLFLOW_PARAM_CHARS
            flat[f"{prefix}{key}"] = text[: MLFLOW_PARAM_CHARS - 3] + "..." if cut else text
    return flat


def _run_id(run_dir: Path, file: str, resume: bool) -> str | None:
    """The id a sink's earlier attempt of this run stored, when resuming."""
    path = run_dir / file
    if resume and path.is_file():
        return path.read_text().strip() or None
    return None


def _store_id(run_dir: Path, file: str, run_id: str) -> None:
    path = run_dir / file
    with writing(path):
        path.write_text(run_id + "\n")


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # events of steps after the checkpoint (an attempt that crashed later) are hidden;
        # a run that starts over hides all of an earlier attempt's
        purge_step = start_step + 1 if start_step > 0 else 0
        self.log_dir = run_dir / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, *, failed: bool) -> None:
        self.writer.close()

    def describe(self) -> str:
        return f"tensorboard --logdir {self.log_dir}"


class WandbSink:
    name = "wandb"

    def __init__(
        self, cfg: MonitorConfig, run_dir: Path, resume: bool, config: dict[str, Any]
    ) -> None:
        import wandb

        run_id = _run_id(run_dir, WANDB_ID_FILE, resume) or uuid.uuid4().hex[:16]
        _store_id(run_dir, WANDB_ID_FILE, run_id)
        settings = wandb.Settings(console="off", disable_git=True, save_code=False, silent=True)
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=cfg.run_name or run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            settings=settings,
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self, *, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)

    def describe(self) -> str:
        return f"wandb run {self.run.id} ({self.run.settings.mode}) in {Path(self.run.dir).parent}"


class MlflowSink:
    name = "mlflow"

    def __init__(
        self, cfg: MonitorConfig, run_dir: Path, resume: bool, config: dict[str, Any]
    ) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
        run_id = _run_id(run_dir, MLFLOW_ID_FILE, resume)
        if run_id is not None:
            self.client.get_run(run_id)  # raises when this tracking store does not hold it
            self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(cfg.mlflow_experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(cfg.mlflow_experiment)
            )
            run = self.client.create_run(
                experiment_id,
                run_name=cfg.run_name or run_dir.name,
                tags={"verst.run_dir": str(run_dir.resolve())},
            )
            run_id = run.info.run_id
            params = [Param(k, v) for k, v in flat_config(config).items()]
            for i in range(0, len(params), MLFLOW_PARAMS_BATCH):
                self.client.log_batch(run_id, params=params[i : i + MLFLOW_PARAMS_BATCH])
            _store_id(run_dir, MLFLOW_ID_FILE, run_id)
        self.run_id = run_id

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(k), value, now_ms, step) for k, value in scalars.items()]
        for i in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MLFLOW_BATCH])

    def close(self, *, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    def describe(self) -> str:
        return f"mlflow run {self.run_id} at {self.client.tracking_uri}"


_MLFLOW_REFUSED = re.compile(r"[^\w\-. :/]")


def mlflow_name(key: str) -> str:
    """`key` as MLflow takes metric names (alphanumerics, `_-. :/` only): `eval/pass@4` is
    `eval/pass_at_4`, any other refused character `_`."""
    return _MLFLOW_REFUSED.sub("_", key.replace("@", "_at_"))


EXTRA = "pip install -e '.[monitor]'"
MLFLOW_URI_ENV = "MLFLOW_TRACKING_URI"
MLFLOW_HINT = (
    "set monitor.mlflow_tracking_uri or $MLFLOW_TRACKING_URI (a server, http://HOST:PORT, or a "
    "local store, file:DIR with MLFLOW_ALLOW_FILE_STORE=true)"
)


def open_sink(
    name: str, cfg: MonitorConfig, run_dir: Path, start_step: int, config: dict[str, Any]
) -> Sink:
    """Start one sink; any failure is a `SinkError` naming it."""
    resume = start_step > 0
    try:
        if name == "tensorboard":
            return TensorBoardSink(run_dir, start_step)
        if name == "wandb":
            return WandbSink(cfg, run_dir, resume, config)
        if name == "mlflow":
            return MlflowSink(cfg, run_dir, resume, config)
    except ImportError as error:
        raise SinkError(
            f"monitor.sinks: {name} needs the {error.name or name} package ({EXTRA})"
        ) from error
    except Exception as error:
        hint = ""
        if name == "mlflow" and not (cfg.mlflow_tracking_uri or os.environ.get(MLFLOW_URI_ENV)):
            hint = f"; with no tracking URI MLflow tried its default: {MLFLOW_HINT}"
        raise SinkError(
            f"monitor.sinks: {name} failed to start: {_describe(error)}{hint}"
        ) from error
    raise SinkError(f"monitor.sinks: unknown sink {name!r}")


class SinkSet:
    """The started sinks of a run: each record to every one; a failure warns once."""

    def __init__(self, sinks: list[Sink], warn: Callable[[str], None]) -> None:
        self.sinks = sinks
        self.warn = warn
        self.failures = {sink.name: 0 for sink in sinks}
        self.writes = 0

    @classmethod
    def open(
        cls,
        cfg: MonitorConfig,
        run_dir: Path,
        *,
        start_step: int,
        config: dict[str, Any],
        warn: Callable[[str], None],
    ) -> SinkSet:
        started: list[Sink] = []
        try:
            for name in cfg.sinks:
                if name != "jsonl":  # metrics.jsonl is MetricsLogger's own
                    started.append(open_sink(name, cfg, run_dir, start_step, config))
        except BaseException:
            for sink in started:
                sink.close(failed=True)
            raise
        return cls(started, warn)

    def log(self, record: dict[str, Any]) -> None:
        if not self.sinks:
            return
        numbers, step = scalars(record), int(record["step"])
        self.writes += 1
        for sink in self.sinks:
            try:
                sink.log(numbers, step)
            except Exception as error:
                self.failures[sink.name] += 1
                if self.failures[sink.name] == 1:
                    self.warn(
                        f"monitor.sinks: {sink.name} failed at step {step} ({_describe(error)}); "
                        "the run goes on and keeps writing to it (said once)"
                    )

    def close(self, *, failed: bool) -> None:
        for sink in self.sinks:
            try:
                sink.close(failed=failed)
            except Exception as error:
                self.warn(f"monitor.sinks: {sink.name} failed to close ({_describe(error)})")
            lost = self.failures[sink.name]
            if lost:
                self.warn(f"monitor.sinks: {sink.name} lost {lost} of {self.writes} steps' metrics")


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
