"""What `verst dashboard` serves of one run directory: its metrics records since the page's
last poll, what it skipped, the advisor's advice replayed over the run, and its samples.

Owns `RunSource`. The files are read again only when they changed (size or modification time),
so a page polling a finished run costs a stat. Records go out in file order with a cursor (the
number of whole records the page holds): the page merges them by step as
`verst.monitor.records.merge_records` does, so an evaluation written late still lands on its
step. A file that shrank (a resume trims it to its checkpoint) resets the page's copy. Values
that are not finite numbers go out as null, counted in `skipped`; text values stay behind.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from verst.monitor import advisor
from verst.monitor.records import METRICS_FILE, merge_records, parse_records
from verst.monitor.samples import read_samples


def _numbers(record: dict[str, Any], bad: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {"step": record["step"]}
    if "record" in record:
        out["record"] = str(record["record"])
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or key == "step":
            continue
        if math.isfinite(value):
            out[key] = value
        else:
            out[key] = None
            bad[key] = bad.get(key, 0) + 1
    return out


def _facts(run_dir: Path) -> tuple[advisor.RunFacts, int]:
    """The advisor's facts and window from the run's config.yaml (defaults without one)."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    config = config if isinstance(config, dict) else {}
    window = (config.get("monitor") or {}).get("advisor_window_steps", 10)
    return advisor.RunFacts.from_config(config), int(window)


def advice_episodes(rows: list[dict[str, Any]], run_dir: Path) -> list[dict[str, Any]]:
    """The advisor's advice over `rows`, one entry for each run of consecutive steps a rule
    fired in (with its latest message), latest first."""
    facts, window = _facts(run_dir)
    watcher = advisor.Advisor(facts, window)
    open_: dict[str, dict[str, Any]] = {}
    episodes: list[dict[str, Any]] = []
    for row in rows:
        fired = {a.rule: a for a in watcher.observe(row)}
        for rule in [r for r in open_ if r not in fired]:
            del open_[rule]
        for rule, item in fired.items():
            if rule not in open_:
                open_[rule] = {"rule": rule, "first_step": item.step}
                episodes.append(open_[rule])
            open_[rule] |= {"last_step": item.step, "message": item.message}
    return sorted(episodes, key=lambda e: (e["last_step"], e["first_step"]), reverse=True)


class RunSource:
    def __init__(self, run_dir: Path, label: str) -> None:
        self.run_dir = run_dir
        self.label = label
        self._stamp: tuple | None = None
        self._records: list[dict[str, Any]] = []
        self._skipped: list[str] = []
        self._advice: list[dict[str, Any]] = []
        self._samples: dict[int, list[dict[str, Any]]] = {}

    def _stat(self) -> tuple:
        stamps = []
        for name in (METRICS_FILE, "samples.jsonl", "config.yaml"):
            try:
                st = (self.run_dir / name).stat()
                stamps.append((st.st_size, st.st_mtime_ns))
            except OSError:
                stamps.append(None)
        return (self.run_dir.is_dir(), *stamps)

    def _load(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        path = self.run_dir / METRICS_FILE
        if not self.run_dir.is_dir():
            self._records, self._skipped = [], [f"{self.run_dir}: no such run directory"]
        elif not path.is_file():
            self._records = []
            self._skipped = [f"{self.run_dir}: no {METRICS_FILE} yet (a run that has not logged)"]
        else:
            raw, self._skipped = parse_records(path, path.read_text(errors="replace"))
            bad: dict[str, int] = {}
            self._records = [_numbers(r, bad) for r in raw]
            self._skipped += [
                f"{self.label}: {n} NaN or infinite values of {key} not plotted"
                for key, n in sorted(bad.items())
            ]
        self._advice = advice_episodes(merge_records(self._records), self.run_dir)
        self._samples, sample_skips = read_samples(self.run_dir)
        self._skipped += sample_skips if self._records else []

    def poll(self, cursor: int) -> dict[str, Any]:
        """The page's update: the records after its first `cursor`, or all with `reset`."""
        self._load()
        reset = cursor > len(self._records) or cursor < 0
        start = 0 if reset else cursor
        return {
            "label": self.label,
            "run_dir": str(self.run_dir),
            "reset": reset,
            "cursor": len(self._records),
            "records": self._records[start:],
            "skipped": self._skipped,
            "advice": self._advice,
            "sample_steps": sorted(self._samples),
        }

    def samples(self, step: int) -> list[dict[str, Any]]:
        self._load()
        return [_json_safe(s) for s in self._samples.get(step, [])]


def _json_safe(value: Any) -> Any:
    """`value` with its non-finite floats as None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value
