"""Run metrics: one JSON object per step in `metrics.jsonl`, one console line, a progress bar.

Only rank 0 writes. The JSONL file is appended to, so a resumed run continues the same file; a
write that fails (a full disk) raises `verst.rundir.RunDirError` naming the file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from verst import distributed
from verst.rundir import append_record

CONSOLE_KEYS = (
    ("rollout/reward_mean", "reward"),
    ("rollout/response_len_mean", "len"),
    ("train/loss", "loss"),
    ("sft/loss", "sft_loss"),
    ("train/grad_norm", "gnorm"),
    ("train/train_rollout_logprob_abs_diff", "lp_diff"),
    ("eval/loss", "eval_loss"),
    ("eval/accuracy", "eval_acc"),
    ("buffer/queue_size", "queue"),
    ("buffer/staleness_max", "stale_max"),
    ("perf/step_time_s", "s/step"),
)


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


class MetricsLogger:
    def __init__(
        self, run_dir: Path, total_steps: int, start_step: int, *, label: str = "RL"
    ) -> None:
        self.enabled = distributed.rank() == 0
        self.path = run_dir / "metrics.jsonl"
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.enabled,
            transient=True,
        )
        self.task = self.progress.add_task("rl", total=total_steps, completed=start_step)

    def __enter__(self) -> MetricsLogger:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False, soft_wrap=True)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        append_record(self.path, metrics)  # a failed write stops the run: no record is lost
        parts = [f"step {metrics['step']}"]
        parts += [
            f"{short} {_format(metrics[key])}" for key, short in CONSOLE_KEYS if key in metrics
        ]
        self.console.print(" | ".join(parts), highlight=False, soft_wrap=True)
        if metrics.get("buffer/advisory"):
            self.console.print(f"  advisory: {metrics['buffer/advisory']}", highlight=False)
        self.progress.update(self.task, completed=metrics["step"])
