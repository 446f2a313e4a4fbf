"""The samples record: a few samples of each step in `RUN_DIR/samples.jsonl`, for the sample
viewer of `verst dashboard`.

Owns `SampleRecorder` (writing, rank 0 only) and `read_samples` (reading back). Each line is one
sample: its step, group and index, the prompt, the response as text and as one decoded piece a
token, the engine's log-prob of each response token, the loss mask, reward, status and the
weight version of each turn. `monitor.samples_per_step` bounds the samples a step (taken from
different groups, the best and the worst rewarded in turn), so the file grows by at most that
many lines a step. A resumed run appends; a step recorded twice keeps its later lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verst import distributed
from verst.rundir import writing
from verst.types import Group, Sample

SAMPLES_FILE = "samples.jsonl"


def pick(groups: list[Group], n: int) -> list[Sample]:
    """Up to `n` samples, one a group while groups last: the best rewarded of even groups and
    the worst of odd ones first, then the next of each."""
    ranked = [
        sorted(group, key=lambda s: s.reward or 0.0, reverse=i % 2 == 0)
        for i, group in enumerate(groups)
    ]
    picked: list[Sample] = []
    for rank in range(max(map(len, ranked), default=0)):
        picked += [group[rank] for group in ranked if rank < len(group)]
    return picked[:n]


def sample_record(step: int, sample: Sample, piece: Callable[[int], str]) -> dict[str, Any]:
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    return {
        "step": step,
        "group": sample.group_index,
        "index": sample.index,
        "prompt": sample.prompt,
        "response_tokens": [piece(t) for t in response],
        "logprobs": list(sample.rollout_logprobs),
        "loss_mask": list(sample.loss_mask),
        "reward": sample.reward,
        "status": sample.status.value,
        "weight_versions": list(sample.weight_versions),
        "label": sample.label if isinstance(sample.label, str | int | float) else None,
    }


class SampleRecorder:
    def __init__(self, run_dir: Path, per_step: int, decode: Callable[[list[int]], str]) -> None:
        """`decode`: token ids to text (each token is decoded alone for the viewer)."""
        self.path = run_dir / SAMPLES_FILE
        self.per_step = per_step if distributed.rank() == 0 else 0
        self.decode = decode

    def record(self, step: int, groups: list[Group]) -> None:
        if not self.per_step:
            return
        lines = [
            json.dumps(sample_record(step, s, lambda t: self.decode([t])), default=str) + "\n"
            for s in pick(groups, self.per_step)
        ]
        with writing(self.path), self.path.open("a") as f:
            f.writelines(lines)


def read_samples(run_dir: Path) -> tuple[dict[int, list[dict[str, Any]]], list[str]]:
    """The samples by step, and what could not be read (one line each)."""
    path = run_dir / SAMPLES_FILE
    if not path.is_file():
        return {}, [f"{run_dir}: no {SAMPLES_FILE} (monitor.samples_per_step=0, or no step yet)"]
    by_step: dict[int, list[dict[str, Any]]] = {}
    bad, last_step = 0, None
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            bad += line.strip() != ""
            continue
        if row["step"] != last_step:  # a step written again (after a resume) starts over
            by_step[row["step"]] = []
            last_step = row["step"]
        by_step[row["step"]].append(row)
    skipped = [f"{path}: {bad} unreadable lines left out"] if bad else []
    return by_step, skipped
