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
    advisor: bool = Field(
        True,
        description="run the advisor's rules each step: advisor/* flags in the metrics, its "
        "verdict on the console line, its advice on the console and in verst dashboard",
    )
    advisor_window_steps: int = Field(
        10, ge=1, description="the advisor's rules look at the metrics of this many recent steps"
    )
    advisor_interval_steps: int = Field(
        10, ge=1, description="the console prints the advisor's advice at most once this many steps"
    )
    samples_per_step: int = Field(
        4,
        ge=0,
        le=1024,
        description="samples of each step written to RUN_DIR/samples.jsonl (prompt, response, "
        "per-token log-probs, loss mask, reward, weight versions) for verst dashboard; 0 = none",
    )

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
