"""Run metrics: one JSON object per step in `metrics.jsonl`, the same numbers to the other sinks
of `monitor.sinks` (TensorBoard, W&B, MLflow: `verst.monitor.sinks`), one console line with the
tokens per second, the time left and the advisor's verdict (`verst.monitor.advisor`: its
`advisor/*` flags join each step's record), a progress bar, and with `monitor.trace` the run's
trace.

Only rank 0 writes metrics (every rank traces). The JSONL file is appended to, so a resumed run
continues the same file; a write that fails (a full disk) raises `verst.rundir.RunDirError`
naming the file. The other sinks are started on entering the logger and closed on leaving it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from verst import distributed
from verst.monitor import advisor, trace
from verst.monitor.config import MonitorConfig
from verst.monitor.sinks import SinkSet
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
    ("perf/tokens_per_s", "tok/s"),
)
ETA_WINDOW_STEPS = 20  # the time left is estimated from the pace of the last this many steps


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def format_duration(seconds: float) -> str:
    """`h:mm:ss`, as the progress bar shows times."""
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class Pace:
    """The time left, from the wall-clock pace of the last `ETA_WINDOW_STEPS` steps logged
    (evaluations and checkpoints included, as they will be in the steps to come)."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self._marks: deque[tuple[float, int]] = deque(maxlen=ETA_WINDOW_STEPS + 1)

    def mark(self, step: int) -> None:
        """`step` is done now (a step marked again, such as step 0 after the warm start,
        counts from its latest mark)."""
        if self._marks and self._marks[-1][1] == step:
            self._marks.pop()
        self._marks.append((time.monotonic(), step))

    def eta_s(self) -> float | None:
        if len(self._marks) < 2:
            return None
        (t0, s0), (t1, s1) = self._marks[0], self._marks[-1]
        if s1 <= s0:
            return None
        return (t1 - t0) / (s1 - s0) * max(self.total_steps - s1, 0)


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        *,
        label: str = "RL",
        monitor: MonitorConfig | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """`monitor`: the sinks and trace to open on entering (default: metrics.jsonl alone);
        `config`: the resolved config, which W&B and MLflow record with the run."""
        self.enabled = distributed.rank() == 0
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.start_step = start_step
        self.monitor = monitor or MonitorConfig()
        self.config = config or {}
        self.sinks = SinkSet([], self.info)
        self.pace = Pace(total_steps)
        facts = advisor.RunFacts.from_config(self.config)
        self.advisor = advisor.Advisor(facts, self.monitor.advisor_window_steps)
        self._advised_step: int | None = None  # the step whose advice the console last printed
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[pace]}"),
            console=self.console,
            disable=not self.enabled,
            transient=True,
        )
        self.task = self.progress.add_task("rl", total=total_steps, completed=start_step, pace="")

    def __enter__(self) -> MetricsLogger:
        if self.enabled:
            self.sinks = SinkSet.open(
                self.monitor,
                self.run_dir,
                start_step=self.start_step,
                config=self.config,
                warn=self.info,
            )
            for sink in self.sinks.sinks:
                self.info(f"monitor: {sink.describe()}")
        if self.monitor.trace:
            rank = distributed.rank()
            try:
                trace.start(self.run_dir / trace.trace_file(rank), f"trainer rank {rank}")
            except BaseException:
                self.sinks.close(failed=True)
                raise
        self.progress.start()
        self.pace.mark(self.start_step)
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.progress.stop()
        try:
            self.sinks.close(failed=exc_type is not None)
        finally:
            trace.stop()

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False, soft_wrap=True)

    def log(self, metrics: dict[str, Any]) -> None:
        trace.flush()
        if not self.enabled:
            return
        advice = self._advise(metrics)
        if advice is not None:
            metrics = metrics | advisor.flags(advice)
        append_record(self.path, metrics)  # a failed write stops the run: no record is lost
        self.sinks.log(metrics)
        self.pace.mark(metrics["step"])
        eta_s = self.pace.eta_s()
        parts = [f"step {metrics['step']}"]
        parts += [
            f"{short} {_format(metrics[key])}" for key, short in CONSOLE_KEYS if key in metrics
        ]
        if eta_s is not None:
            parts.append(f"eta {format_duration(eta_s)}")
        if advice is not None:
            parts.append(f"advisor {advisor.verdict(advice)}")
        self.console.print(" | ".join(parts), highlight=False, soft_wrap=True)
        self._print_advice(metrics["step"], advice or [])
        pace = [f"eta {format_duration(eta_s)}"] if eta_s is not None else []
        if "perf/tokens_per_s" in metrics:
            pace.append(f"{metrics['perf/tokens_per_s']:.4g} tok/s")
        if advice is not None:
            pace.append(f"advisor {advisor.verdict(advice)}")
        self.progress.update(self.task, completed=metrics["step"], pace=" ".join(pace))

    def _advise(self, metrics: dict[str, Any]) -> list[advisor.Advice] | None:
        """The advice on a step's record; None with the advisor off and for the records that
        are not a step's (an evaluation recorded at the step it measured)."""
        if not self.monitor.advisor or "record" in metrics:
            return None
        return self.advisor.observe(metrics)

    def _print_advice(self, step: int, advice: list[advisor.Advice]) -> None:
        interval = self.monitor.advisor_interval_steps
        if not advice or (self._advised_step is not None and step - self._advised_step < interval):
            return
        self._advised_step = step
        also = f" (also: {advisor.verdict(advice[1:])})" if len(advice) > 1 else ""
        self.console.print(f"  advisor: {advice[0].message}{also}", highlight=False, soft_wrap=True)
