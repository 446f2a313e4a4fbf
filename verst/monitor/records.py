"""Reading a run's `metrics.jsonl` back, for tools that show runs (`verst plot`): whatever can
be read, and one line for each thing that could not.

A run directory that does not exist or holds no metrics, a last line cut off mid-write (a run
still writing, or one killed while it wrote), a line that is not a JSON object with an integer
`step`: each is left out and named in `RunMetrics.skipped`. A step recorded twice keeps its last
record; an evaluation's own record (`"record": "eval"`) joins its step's. Values that are not
finite numbers are left out of a series and counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


@dataclass
class RunMetrics:
    run_dir: Path
    rows: list[dict[str, Any]] = field(default_factory=list)  # one a step, in step order
    skipped: list[str] = field(default_factory=list)

    @property
    def keys(self) -> set[str]:
        return {key for row in self.rows for key in row}

    def series(self, key: str) -> tuple[list[int], list[float], int]:
        """(steps, values) of `key`'s finite numbers, and how many values were not finite."""
        steps, values, bad = [], [], 0
        for row in self.rows:
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                steps.append(row["step"])
                values.append(float(value))
            else:
                bad += 1
        return steps, values, bad


def parse_records(path: Path, text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every whole record of a metrics file's `text`, in file order, and a line for each line
    left out."""
    lines = text.split("\n")
    cut_off = lines[-1] != ""  # every whole record ends with a newline
    records, skipped = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            if number == len(lines) and cut_off:
                skipped.append(
                    f"{path}: the last line is cut off (a run still writing, or stopped while "
                    "it wrote); left out"
                )
            else:
                skipped.append(f"{path}:{number}: not a JSON record with a step; left out")
            continue
        records.append(row)
    return records, skipped


def merge_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row a step, in step order: a step's record replaces an earlier one of that step (a
    resumed run), a record of its own kind (`record`: an evaluation written when it finished,
    at the step it measured) adds its keys to its step's row."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in records:
        step = row["step"]
        if "record" in row and step in by_step:
            by_step[step] = by_step[step] | {k: v for k, v in row.items() if k != "record"}
        else:
            by_step[step] = dict(row)
    return [by_step[step] for step in sorted(by_step)]


def read_run(run_dir: Path) -> RunMetrics:
    run = RunMetrics(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        run.skipped.append(f"{run_dir}: no such run directory")
        return run
    if not path.is_file():
        run.skipped.append(f"{run_dir}: no {METRICS_FILE} (a run that has not logged a step)")
        return run
    records, run.skipped = parse_records(path, path.read_text(errors="replace"))
    run.rows = merge_records(records)
    if not run.rows:
        run.skipped.append(f"{path}: no readable record")
    return run
