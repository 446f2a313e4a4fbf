"""The prompt ledger: `run_dir/prompts.jsonl`, what became of every group the rollout served.

Each prompt is known by `(epoch, prompt_id)`: `prompt_id` is its row's 0-based position in the
data file or task split (file order, before shuffling), `epoch` the data source's pass over the
prompts that first served it; a prompt given back to be served again keeps both (see
`verst.data.source`). One JSON line is written per group whose fate is decided:

    {"step": 7, "prompt_id": 41, "epoch": 0, "outcome": "retried", "reason": "stale"}

`step` is the trainer step during which the fate was decided (between two steps, the next one's).
Outcomes:

- `trained`: the group went into step `step`'s batch (its reason is empty);
- `retried`: not trained; its prompt was given back, to be served again (a retry, except for
  `surplus`);
- `dropped`: not trained and never served again;
- `pending`: written when a run ends normally, for every prompt it still holds undecided (given
  back and not served yet, generating, or waiting in the fully async buffer): a checkpoint holds
  them, so a resumed run serves them again;
- `undone`: the line's step came after the checkpoint a resumed run restarted from
  (`undo_after`); its original outcome is kept under `"was"`, its reason becomes "trainer
  restarted from step S". The serve stays in the history; it counts for nothing.

Reasons: `aborted` (a sample was aborted; fully async mode drops the whole group), `too few
scored samples` (fewer than `rollout.min_scored_samples` samples neither ABORTED nor FAILED),
`stale` (fully async: older than `max_staleness` versions at take), `filter: <reason>`
(`rollout.filter` dropped it; dynamic sampling's is `filter: no reward variance`; a rollout
function's own drops too), `surplus` (a filter kept more groups than the batch holds: given
back, not counted as a retry), `retries exhausted (<reason>)` (the prompt was already retried
`rollout.max_prompt_retries` times), `run ended` (pending).

`Ledger` writes (rank 0 only, thread-safe: the fully async worker decides fates on the fleet's
event-loop thread), counts the fates of each step for the metrics, and logs each prompt dropped
for exhausted retries. `check_exactly_once` reads a ledger back and says whether every prompt
was trained at most once per epoch and none was lost.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verst import distributed
from verst.types import Group

log = logging.getLogger(__name__)

LEDGER_FILE = "prompts.jsonl"

TRAINED = "trained"
RETRIED = "retried"
DROPPED = "dropped"
PENDING = "pending"
UNDONE = "undone"
OUTCOMES = (TRAINED, RETRIED, DROPPED, PENDING, UNDONE)

ABORTED = "aborted"
TOO_FEW_SCORED = "too few scored samples"
STALE = "stale"
NO_VARIANCE = "no reward variance"
SURPLUS = "surplus"
RETRIES_EXHAUSTED = "retries exhausted"
RUN_ENDED = "run ended"
FILTERED = "filter: "  # + the filter's reason


def filtered(reason: str) -> str:
    """The ledger reason of a group `rollout.filter` dropped for `reason`."""
    return FILTERED + reason


def drop_metric(reason: str) -> str:
    """The metric that counts the groups a filter dropped for `reason`."""
    slug = re.sub(r"\W+", "_", reason.strip().lower()).strip("_")
    return f"rollout/filter/drop_{slug or 'unnamed'}"


@dataclass(frozen=True)
class Fate:
    """What became of one group: its prompt's identity, the prompt's retry count after this
    fate (one more than the group's when this fate is a counted retry), outcome and reason."""

    prompt_id: int | None
    epoch: int | None
    retries: int
    outcome: str
    reason: str = ""

    @classmethod
    def of(cls, group: Group, outcome: str, reason: str = "") -> Fate:
        first = group[0]
        return cls(first.prompt_id, first.epoch, first.retries, outcome, reason)

    def line(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "prompt_id": self.prompt_id,
            "epoch": self.epoch,
            "outcome": self.outcome,
            "reason": self.reason,
        }


def unused_fate(group: Group, reason: str, *, retry: bool, max_retries: int | None) -> Fate:
    """The fate of a group that will not be trained: `retried` (its retry count one higher)
    while `retry` is on and its prompt was retried fewer than `max_retries` times (None: no
    cap); `dropped` otherwise, with reason "retries exhausted (<reason>)" when the cap is what
    stopped it."""
    first = group[0]
    if not retry:
        return Fate.of(group, DROPPED, reason)
    if max_retries is not None and first.retries >= max_retries:
        return Fate.of(group, DROPPED, f"{RETRIES_EXHAUSTED} ({reason})")
    return Fate(first.prompt_id, first.epoch, first.retries + 1, RETRIED, reason)


class Ledger:
    """Appends fates to the ledger file and counts them; on a rank other than 0 it does
    nothing (rank 0 records every rank's groups). `path=None` counts without writing.

    `step` is the step stamped on the fates recorded now; the loop sets it to the step that
    runs next as soon as the previous one (and its checkpoint) is done.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.enabled = distributed.rank() == 0
        self.step = 0
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def record(self, fates: Iterable[Fate]) -> None:
        """Write one line per fate (stamped with `step`) and count it."""
        if not self.enabled:
            return
        fates = list(fates)
        with self._lock:
            step = self.step
            for fate in fates:
                self._count(fate)
            self._write([fate.line(step) for fate in fates])

    def record_pending(self, prompts: Iterable[dict[str, Any]]) -> None:
        """One `pending` line per prompt a run that ends still holds: the `returned` entries of
        a data source's `state_dict` (identities with `prompt_id` and `epoch`)."""
        self.record(
            Fate(side.get("prompt_id"), side.get("epoch"), 0, PENDING, RUN_ENDED)
            for side in prompts
        )

    def take_counts(self) -> dict[str, float]:
        """This step's fates so far (since the previous call), as `rollout/*` metrics: groups
        `retried` and `dropped`, groups with `too_few_scored` samples (retried or dropped),
        prompts dropped after `retries_exhausted`, and `filter/drop_<reason>` for each reason a
        filter gave this step."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        keys = ("groups_retried", "groups_dropped", "too_few_scored_groups", "retries_exhausted")
        out = {f"rollout/{key}": float(counts.pop(key, 0)) for key in keys}
        return out | {metric: float(n) for metric, n in counts.items()}  # filter drops

    def _count(self, fate: Fate) -> None:
        if fate.outcome == RETRIED:
            self._counts["groups_retried"] += 1
        elif fate.outcome == DROPPED:
            self._counts["groups_dropped"] += 1
        if fate.reason.startswith(FILTERED):
            self._counts[drop_metric(fate.reason[len(FILTERED) :])] += 1
        if TOO_FEW_SCORED in fate.reason:
            self._counts["too_few_scored_groups"] += 1
        if fate.reason.startswith(RETRIES_EXHAUSTED):
            self._counts["retries_exhausted"] += 1
            log.warning(
                "prompt %s (epoch %s) dropped: %s after %d retries",
                fate.prompt_id,
                fate.epoch,
                fate.reason,
                fate.retries,
            )

    def _write(self, lines: list[dict[str, Any]]) -> None:
        if self.path is None or not lines:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The ledger's lines, in the order they were written."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def undo_after(path: Path, step: int) -> None:
    """A resume from checkpoint `step`: every line of a later step becomes `undone` (reason
    "trainer restarted from step S", the old outcome under "was"), so the serve stays in the
    history and the prompt is not counted as trained twice. Rank 0 only; no file, no change."""
    if distributed.rank() != 0 or not path.is_file():
        return
    lines = read_ledger(path)
    for line in lines:
        if line["step"] > step and line["outcome"] != UNDONE:
            line["was"] = line["outcome"]
            line["outcome"] = UNDONE
            line["reason"] = f"trainer restarted from step {step}"
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    partial.replace(path)


@dataclass
class LedgerReport:
    """What `check_exactly_once` found; every mapping is epoch -> sorted prompt ids.

    - `trained_twice`: trained more than once in one epoch (must be empty);
    - `lost`: of a fully consumed epoch, never trained, never dropped, and not `pending` at the
      end of the last run: served, then gone without a trace (must be empty);
    - `trained`, `dropped`, `pending`: prompts trained (at least once), dropped (and never
      trained), and left pending by the last run (never trained);
    - `complete_epochs`: the epochs checked for `lost`;
    - `serves`: live lines (not `undone`) per outcome, over the whole ledger.
    """

    num_prompts: int
    complete_epochs: list[int]
    trained_twice: dict[int, list[int]] = field(default_factory=dict)
    lost: dict[int, list[int]] = field(default_factory=dict)
    trained: dict[int, list[int]] = field(default_factory=dict)
    dropped: dict[int, list[int]] = field(default_factory=dict)
    pending: dict[int, list[int]] = field(default_factory=dict)
    serves: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No prompt trained twice in an epoch, and none lost."""
        return not self.trained_twice and not self.lost

    def summary(self) -> str:
        """One line, for logs and assertion messages."""
        return (
            f"{'ok' if self.ok else 'NOT OK'}: complete epochs {self.complete_epochs}; "
            f"trained twice {self.trained_twice}; lost {self.lost}; "
            f"dropped {self.dropped}; pending {self.pending}; serves {self.serves}"
        )


def check_exactly_once(
    path: Path, num_prompts: int, *, complete_epochs: Iterable[int] | None = None
) -> LedgerReport:
    """Check a run's ledger (`run_dir/prompts.jsonl`) for exactly-once training.

    `num_prompts` is the size of the data set (rows of the file or split, after
    `data.max_prompts`). An epoch counts as fully consumed when the ledger has a live line of a
    later epoch (the data source serves epoch e+1 only after every prompt of epoch e), or when
    listed in `complete_epochs`. `undone` lines count for nothing. A line whose prompt_id is
    missing or outside 0..num_prompts-1 raises ValueError.
    """
    trained: defaultdict[int, Counter[int]] = defaultdict(Counter)
    dropped: defaultdict[int, set[int]] = defaultdict(set)
    last: dict[tuple[int, int], str] = {}
    serves: Counter[str] = Counter()
    for number, line in enumerate(read_ledger(path), start=1):
        outcome = line["outcome"]
        if outcome == UNDONE:
            continue
        prompt_id, epoch = line.get("prompt_id"), line.get("epoch")
        if not isinstance(prompt_id, int) or not 0 <= prompt_id < num_prompts:
            raise ValueError(f"{path}:{number}: prompt_id {prompt_id!r} outside 0..{num_prompts}")
        if not isinstance(epoch, int):
            raise ValueError(f"{path}:{number}: epoch {epoch!r} is not an integer")
        serves[outcome] += 1
        last[epoch, prompt_id] = outcome
        if outcome == TRAINED:
            trained[epoch][prompt_id] += 1
        elif outcome == DROPPED:
            dropped[epoch].add(prompt_id)
    seen = {epoch for epoch, _ in last}
    complete = {e for e in seen if any(later > e for later in seen)}
    complete |= set(complete_epochs or ())
    pending = {e: {p for (e2, p), o in last.items() if e2 == e and o == PENDING} for e in seen}
    report = LedgerReport(num_prompts, sorted(complete), serves=dict(serves))
    for epoch in sorted(seen | complete):
        counts = trained[epoch]
        twice = sorted(p for p, n in counts.items() if n > 1)
        if twice:
            report.trained_twice[epoch] = twice
        report.trained[epoch] = sorted(counts)
        never = dropped[epoch] - set(counts)
        if never:
            report.dropped[epoch] = sorted(never)
        waiting = pending.get(epoch, set()) - set(counts)
        if waiting:
            report.pending[epoch] = sorted(waiting)
        if epoch in complete:
            lost = set(range(num_prompts)) - set(counts) - dropped[epoch] - waiting
            if lost:
                report.lost[epoch] = sorted(lost)
    return report
