"""`verst plot RUN_DIR [RUN_DIR ...] -o out.png`: the main curves of one run, or of several
overlaid, as one static PNG (matplotlib, `pip install -e '.[plot]'`).

Panels: reward, held-out accuracy, response length, the train/rollout log-prob difference and
KL, the gradient norm, and the phase breakdown (mean seconds a step in each phase of the loop,
one stacked bar a run). What cannot be shown is said, one line each (`Plot.skipped`): a run
directory that is missing or unreadable lines of its metrics (`verst.monitor.records`), values
that are NaN or infinite, a panel's metric that some runs lack, a panel no run has data for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verst.monitor.records import RunMetrics, read_run
from verst.rundir import writing

# (title, keys drawn in it, log scale when every value is positive)
PANELS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("reward (rollout/reward_mean)", ("rollout/reward_mean",), False),
    ("held-out accuracy (eval/accuracy)", ("eval/accuracy",), False),
    ("response length, tokens (rollout/response_len_mean)", ("rollout/response_len_mean",), False),
    (
        "train vs rollout: |log-prob diff| and KL",
        ("train/train_rollout_logprob_abs_diff", "train/train_rollout_kl", "train/kl_loss"),
        True,
    ),
    ("gradient norm (train/grad_norm)", ("train/grad_norm",), False),
)
PHASE_KEY = re.compile(r"^perf/(.+)_time_s$")
# the loop's phases in the order a step runs them; others (a plug-in's) follow by name
LOOP_ORDER = ("rollout", "wait", "reward", "teacher", "advantages", "train", "sync", "eval")


class PlotError(ValueError):
    """Nothing could be plotted: no run given could be read."""


@dataclass
class Plot:
    path: Path
    runs: list[RunMetrics]
    skipped: list[str] = field(default_factory=list)


def loop_phases(run: RunMetrics) -> dict[str, float]:
    """Seconds a step of each phase of the loop (not the sub-phases, such as `train_forward`
    inside `train`, nor the step total), averaged over every timed step: a phase that runs
    every tenth step (an evaluation) counts a tenth of its time."""
    phases = {m.group(1) for key in run.keys if (m := PHASE_KEY.match(key))} - {"step"}
    top = [p for p in phases if not any(p.startswith(f"{q}_") for q in phases if q != p)]
    timed_steps = len(run.series("perf/step_time_s")[0]) or 1
    means = {}
    for phase in sorted(top, key=lambda p: (LOOP_ORDER.index(p) if p in LOOP_ORDER else 99, p)):
        steps, values, _ = run.series(f"perf/{phase}_time_s")
        if steps:
            means[phase] = sum(values) / timed_steps
    return means


def _labels(runs: list[RunMetrics]) -> list[str]:
    names = [run.run_dir.name or str(run.run_dir) for run in runs]
    return [str(r.run_dir) if names.count(n) > 1 else n for r, n in zip(runs, names, strict=True)]


def _curves(
    ax: Any, runs: list[RunMetrics], labels: list[str], panel: tuple, skipped: list[str]
) -> None:
    from matplotlib.ticker import MaxNLocator

    title, keys, log_scale = panel
    drawn, positive = 0, True
    for run, label in zip(runs, labels, strict=True):
        present = [key for key in keys if key in run.keys]
        if not present:
            others = [lb for r, lb in zip(runs, labels, strict=True) if set(keys) & r.keys]
            if others:
                skipped.append(f"{title}: {label} has no {' / '.join(keys)}")
            continue
        for key in present:
            steps, values, bad = run.series(key)
            if bad:
                skipped.append(f"{label}: {bad} NaN or infinite values of {key} not plotted")
            if not steps:
                continue
            short = key.split("/", 1)[1]
            name = label if len(keys) == 1 else f"{label}: {short}"
            ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=name)
            drawn += 1
            positive = positive and min(values) > 0
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not drawn:
        skipped.append(f"{title}: no run has data for it")
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    if log_scale and positive:
        ax.set_yscale("log")
    if drawn > 1:
        ax.legend(fontsize=8)


def _phases(ax: Any, runs: list[RunMetrics], labels: list[str], skipped: list[str]) -> None:
    means = [loop_phases(run) for run in runs]
    phases = list(dict.fromkeys(p for m in means for p in m))
    ax.set_title("phase breakdown: mean seconds a step", fontsize=10)
    if not phases:
        skipped.append("phase breakdown: no run has perf/*_time_s")
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    lefts = [0.0] * len(runs)
    for phase in phases:
        widths = [m.get(phase, 0.0) for m in means]
        ax.barh(labels, widths, left=lefts, label=phase)
        lefts = [a + b for a, b in zip(lefts, widths, strict=True)]
    ax.set_xlabel("seconds (phases that skip steps count their share)")
    ax.legend(fontsize=8)


def plot_runs(run_dirs: list[Path], out: Path) -> Plot:
    """Draw `run_dirs` into the PNG `out`; raises `PlotError` when none could be read."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    read = [read_run(d) for d in run_dirs]
    skipped = [line for run in read for line in run.skipped]
    runs = [run for run in read if run.rows]
    if not runs:
        raise PlotError("no run to plot: " + "; ".join(skipped))
    labels = _labels(runs)
    figure, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    for ax, panel in zip(axes.flat, PANELS, strict=False):
        _curves(ax, runs, labels, panel, skipped)
    _phases(axes.flat[len(PANELS)], runs, labels, skipped)
    figure.suptitle(", ".join(labels))
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=100)
    plt.close(figure)
    return Plot(out, runs, skipped)
