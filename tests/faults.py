"""Fault injection for end-to-end tests: a `verst train` subprocess whose engine processes (or
itself) a test kills at chosen steps, at a random moment inside the step."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc; no psutil needed)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name in parentheses may hold spaces: the fields after it are fixed
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == pid:
            children.append(int(entry.name))
    return children


def engine_pids(trainer_pid: int) -> list[int]:
    """The `verst serve` processes a trainer started."""
    pids = []
    for pid in child_pids(trainer_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"verst" in argv and b"serve" in argv:
            pids.append(pid)
    return pids


def complete_records(path: Path) -> list[dict]:
    """The records of a JSONL file another process is appending to: whole lines only (the
    last one may be half written)."""
    if not path.is_file():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line]


def trainer_pid(supervisor_pid: int) -> int | None:
    """The trainer a `verst train --max-restarts` supervisor runs now, if any."""
    children = child_pids(supervisor_pid)
    return children[0] if children else None


@dataclass
class TrainProcess:
    """`python -m verst train` in a subprocess, with its output in `run_dir.log`."""

    overrides: list[str]
    run_dir: Path
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    kills: list[tuple[int, int, str]] = field(default_factory=list)  # (step, pid, signal)

    def start(self) -> TrainProcess:
        cmd = [sys.executable, "-m", "verst", "train", *self.overrides]
        cmd += ["--run-dir", str(self.run_dir), *self.extra_args]
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        self.log = self.run_dir.with_suffix(".log")
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def wait_for_step(self, step: int, timeout_s: float = 300.0) -> None:
        self.wait_until(lambda row: row["step"] >= step, f"step {step}", timeout_s)

    def wait_until(self, ready: Callable[[dict], bool], what: str, timeout_s: float = 120) -> None:
        """Until the last metrics record satisfies `ready`."""
        deadline = time.monotonic() + timeout_s
        while not ((rows := self.records()) and ready(rows[-1])):
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"the run exited before {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} after {timeout_s} s:\n{self.output()}")
            time.sleep(0.05)

    def kill_engine(
        self, step: int, rng: random.Random, sig: int = signal.SIGKILL, within_s: float = 0.5
    ) -> int:
        """Once `step` is logged and every earlier kill's engine has been restarted and has
        rejoined (a hung one is down only once its probe has failed, so the restart count, not
        the engines down, says when), wait a random moment (up to `within_s`), then signal one
        of the trainer's engine processes, chosen at random; returns its pid."""
        self.wait_for_step(step)
        self.wait_until(
            lambda row: (
                row.get("fault/engine_restarts", 0) >= len(self.kills)
                and row.get("fault/engines_down", 0) == 0
            ),
            "engines back",
        )
        time.sleep(rng.uniform(0.0, within_s))
        deadline = time.monotonic() + 60
        while not (pids := engine_pids(self.engines_parent())):  # all restarting: wait for one
            assert time.monotonic() < deadline, "no engine process to kill"
            time.sleep(0.05)
        victim = rng.choice(sorted(pids))
        os.kill(victim, sig)
        self.kills.append((step, victim, signal.Signals(sig).name))
        return victim

    def engines_parent(self) -> int:
        """The process that starts the engines: the trainer (under a supervisor, its child)."""
        if "--max-restarts" not in self.extra_args:
            return self.pid
        return trainer_pid(self.pid) or -1

    def kill_trainer(self, step: int, rng: random.Random, within_s: float = 0.5) -> int:
        """Under `--max-restarts`: once `step` is logged, SIGKILL the trainer at a random
        moment (up to `within_s`) later; returns its pid."""
        self.wait_for_step(step)
        time.sleep(rng.uniform(0.0, within_s))
        victim = trainer_pid(self.pid)
        assert victim is not None, "no trainer to kill"
        os.kill(victim, signal.SIGKILL)
        self.kills.append((step, victim, "SIGKILL"))
        return victim

    def finish(self, timeout_s: float = 600.0) -> int:
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(
                f"the run did not finish in {timeout_s} s:\n{self.output()}"
            ) from None

    def output(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def records(self) -> list[dict]:
        return complete_records(self.run_dir / "metrics.jsonl")


def served_order(overrides: list[str], steps: int) -> list[list[tuple[int, int]]]:
    """The (epoch, prompt_id) of each step's groups in a run that serves prompts in data order,
    none given back: what an uninterrupted synchronous run of this config trains."""
    from verst.config import load_config
    from verst.data.source import DataSource
    from verst.models.loading import load_model_and_tokenizer

    cfg = load_config(None, overrides)
    _, tokenizer = load_model_and_tokenizer(cfg.model, seed=cfg.seed)
    data = DataSource(cfg.data, tokenizer, n_samples_per_prompt=1, seed=cfg.seed)
    order = []
    for _ in range(steps):
        groups = data.take(cfg.rollout.prompts_per_step)
        order.append(sorted((g[0].epoch, g[0].prompt_id) for g in groups))
    return order


def trained_order(run_dir: Path) -> list[list[tuple[int, int]]]:
    """The (epoch, prompt_id) of the groups each step of a run trained (prompts.jsonl)."""
    from verst.rollout.ledger import TRAINED, read_ledger

    steps: dict[int, list[tuple[int, int]]] = {}
    for line in read_ledger(run_dir / "prompts.jsonl"):
        if line["outcome"] == TRAINED:
            steps.setdefault(line["step"], []).append((line["epoch"], line["prompt_id"]))
    return [sorted(steps[s]) for s in sorted(steps)]
