"""The `monitor` section: where a run's metrics go, and whether its phases are traced."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from verst.configbase import ConfigBase

SinkName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


class MonitorConfig(ConfigBase):
    sinks: list[SinkName] = Field(
        default_factory=lambda: ["jsonl"],
        description="where each step's metrics go: jsonl (metrics.jsonl, always on), "
        "tensorboard (RUN_DIR/tensorboard), wandb, mlflow; the same keys go to every sink",
    )
    trace: bool = Field(
        False,
        description="write a Chrome-trace JSON of every timed phase (and of in-process engine "
        "steps) to RUN_DIR/trace.json, for Perfetto or chrome://tracing",
    )
    run_name: str | None = Field(
        None, description="the run's name in W&B and MLflow; unset = the run directory's name"
    )
    wandb_project: str = Field("verst", description="W&B project")
    wandb_entity: str | None = Field(None, description="W&B entity; unset = your default")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI (http://..., file:DIR, ...); unset = "
        "$MLFLOW_TRACKING_URI, else MLflow's default",
    )
    mlflow_experiment: str = Field("verst", description="MLflow experiment, created if missing")

    @field_validator("sinks")
    @classmethod
    def _jsonl_and_no_repeats(cls, sinks: list[str]) -> list[str]:
        if "jsonl" not in sinks:
            raise ValueError(
                "must include jsonl: metrics.jsonl is the run's own record (a resume trims "
                "it to the checkpoint, verst plot reads it)"
            )
        if len(set(sinks)) != len(sinks):
            raise ValueError(f"names a sink twice: {sinks}")
        return sinks
