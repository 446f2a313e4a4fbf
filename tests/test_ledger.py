"""The prompt ledger (`prompts.jsonl`): fates, retries, resume, and exactly-once training, from
closed-form ledgers and from runs through the public CLI."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path

import pytest

from tests.test_loop import SMALL, records
from verst.cli import main
from verst.rollout.ledger import (
    DROPPED,
    PENDING,
    RETRIED,
    TRAINED,
    UNDONE,
    Fate,
    Ledger,
    check_exactly_once,
    read_ledger,
    undo_after,
    unused_fate,
)
from verst.train.checkpoint import checkpoint_dir
from verst.types import Sample

# a quick run: no warm start, no evaluation; 6 prompts of 3 a step, so an epoch is two steps
QUICK = [
    *SMALL,
    "warm_start.enabled=false",
    "eval.interval_steps=0",
    "checkpoint.interval_steps=0",
    "data.max_prompts=6",
    "rollout.prompts_per_step=3",
]
ALWAYS_FAILS, FAILS_ONCE = 1, 4  # prompt ids (rows of the data split)


def fails_on_some_prompts(sample: Sample) -> float:
    """A reward that raises on every sample of prompt ALWAYS_FAILS, and on FAILS_ONCE's the
    first time it is served; 1.0 for a response that starts with a digit."""
    if sample.prompt_id == ALWAYS_FAILS or (sample.prompt_id == FAILS_ONCE and not sample.retries):
        raise ValueError(f"verifier cannot read prompt {sample.prompt_id}")
    return float(sample.metadata["response_text"][:1].isdigit())


def group(prompt_id: int, epoch: int = 0, retries: int = 0) -> list[Sample]:
    return [Sample(prompt_id=prompt_id, epoch=epoch, retries=retries) for _ in range(2)]


def write(path: Path, lines: list[tuple]) -> Path:
    keys = ("step", "prompt_id", "epoch", "outcome", "reason")
    path.write_text(
        "".join(json.dumps(dict(zip(keys, line, strict=True))) + "\n" for line in lines)
    )
    return path


def test_a_group_not_trained_is_retried_until_its_retries_run_out() -> None:
    fate = unused_fate(group(3, epoch=1), "stale", retry=True, max_retries=2)
    assert fate == Fate(3, 1, 1, RETRIED, "stale")
    assert unused_fate(group(3, retries=1), "stale", retry=True, max_retries=2).retries == 2
    assert unused_fate(group(3, retries=2), "aborted", retry=True, max_retries=2) == Fate(
        3, 0, 2, DROPPED, "retries exhausted (aborted)"
    )
    assert unused_fate(group(3), "stale", retry=False, max_retries=2).outcome == DROPPED
    assert unused_fate(group(3, retries=99), "stale", retry=True, max_retries=None).retries == 100
    assert unused_fate(group(3), "stale", retry=True, max_retries=0).outcome == DROPPED


def test_the_ledger_writes_counts_and_logs_fates(tmp_path: Path, caplog) -> None:
    ledger = Ledger(tmp_path / "prompts.jsonl")
    ledger.step = 4
    with caplog.at_level(logging.WARNING, logger="verst.rollout.ledger"):
        ledger.record(
            [
                Fate(0, 0, 0, TRAINED),
                Fate(1, 0, 1, RETRIED, "too few scored samples"),
                Fate(2, 0, 3, DROPPED, "retries exhausted (too few scored samples)"),
                Fate(5, 1, 0, DROPPED, "no reward variance"),
            ]
        )
    assert "prompt 2 (epoch 0) dropped: retries exhausted" in caplog.text
    assert len(caplog.records) == 1
    ledger.record_pending([{"prompt_id": 7, "epoch": 1, "retries": 2}])
    lines = read_ledger(tmp_path / "prompts.jsonl")
    assert lines[0] == {"step": 4, "prompt_id": 0, "epoch": 0, "outcome": "trained", "reason": ""}
    assert [(x["prompt_id"], x["outcome"], x["reason"]) for x in lines[3:]] == [
        (5, DROPPED, "no reward variance"),
        (7, PENDING, "run ended"),
    ]
    assert ledger.take_counts() == {
        "rollout/groups_retried": 1.0,
        "rollout/groups_dropped": 2.0,
        "rollout/too_few_scored_groups": 2.0,
        "rollout/retries_exhausted": 1.0,
    }
    assert set(ledger.take_counts().values()) == {0.0}  # counts are per step


def test_the_ledger_takes_fates_from_several_threads(tmp_path: Path) -> None:
    """The fully async worker records from the fleet's loop thread while the trainer records
    what it takes: every line arrives whole."""
    ledger = Ledger(tmp_path / "prompts.jsonl")

    def write_many(start: int) -> None:
        for i in range(200):
            ledger.record([Fate(start + i, 0, 0, TRAINED), Fate(start + i, 0, 1, RETRIED, "x")])

    threads = [threading.Thread(target=write_many, args=(k * 1000,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = read_ledger(tmp_path / "prompts.jsonl")
    assert len(lines) == 1600 and ledger.take_counts()["rollout/groups_retried"] == 800


def test_a_resume_marks_later_lines_undone(tmp_path: Path) -> None:
    path = write(
        tmp_path / "prompts.jsonl",
        [(1, 0, 0, TRAINED, ""), (2, 1, 0, RETRIED, "stale"), (3, 1, 0, TRAINED, "")],
    )
    undo_after(path, 2)
    lines = read_ledger(path)
    assert lines[:2] == [
        {"step": 1, "prompt_id": 0, "epoch": 0, "outcome": "trained", "reason": ""},
        {"step": 2, "prompt_id": 1, "epoch": 0, "outcome": "retried", "reason": "stale"},
    ]
    assert lines[2] == {
        "step": 3,
        "prompt_id": 1,
        "epoch": 0,
        "outcome": UNDONE,
        "reason": "trainer restarted from step 2",
        "was": TRAINED,
    }
    undo_after(path, 1)  # a second resume, further back: the undone line stays as it was
    assert read_ledger(path)[2]["was"] == TRAINED
    assert read_ledger(path)[1]["was"] == RETRIED
    undo_after(tmp_path / "none.jsonl", 1)  # no ledger: nothing to do


def test_check_exactly_once_closed_form(tmp_path: Path) -> None:
    """Four prompts; epoch 0 is complete (epoch 1 was served), epoch 1 is not."""
    path = write(
        tmp_path / "prompts.jsonl",
        [
            (1, 0, 0, TRAINED, ""),
            (1, 1, 0, RETRIED, "too few scored samples"),
            (1, 2, 0, RETRIED, "aborted"),  # retried, then never seen again: lost
            (2, 1, 0, TRAINED, ""),
            (2, 3, 0, DROPPED, "retries exhausted (stale)"),
            (2, 0, 1, TRAINED, ""),
            (3, 0, 1, TRAINED, ""),  # the same prompt twice in epoch 1
            (3, 2, 1, UNDONE, "trainer restarted from step 2"),
            (4, 3, 1, PENDING, "run ended"),
        ],
    )
    report = check_exactly_once(path, 4)
    assert not report.ok
    assert report.complete_epochs == [0]
    assert report.trained_twice == {1: [0]}
    assert report.lost == {0: [2]}
    assert report.trained == {0: [0, 1], 1: [0]}
    assert report.dropped == {0: [3]} and report.pending == {1: [3]}
    assert report.serves == {TRAINED: 4, RETRIED: 2, DROPPED: 1, PENDING: 1}
    assert "NOT OK" in report.summary() and "lost {0: [2]}" in report.summary()
    # asked to check epoch 1 as well: prompts 1 and 2 were never trained there (3 is pending)
    assert check_exactly_once(path, 4, complete_epochs=[1]).lost == {0: [2], 1: [1, 2]}
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1: prompt_id 0 outside"):
        check_exactly_once(path, 0)


def test_every_prompt_of_the_completed_epochs_is_trained_exactly_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *QUICK, "num_steps=5", "--run-dir", str(run_dir)]) == 0
    lines = read_ledger(run_dir / "prompts.jsonl")
    # 15 prompts served over 5 steps, 3 a step, all trained: two and a half epochs
    assert [x["step"] for x in lines] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5]
    assert {x["outcome"] for x in lines} == {TRAINED}
    report = check_exactly_once(run_dir / "prompts.jsonl", 6)
    assert report.ok, report.summary()
    assert report.complete_epochs == [0, 1]
    assert report.trained == {0: list(range(6)), 1: list(range(6)), 2: report.trained[2]}
    assert len(report.trained[2]) == 3


def test_failing_rewards_are_retried_then_trained_or_dropped(tmp_path: Path, caplog) -> None:
    run_dir = tmp_path / "run"
    reward = f"rollout.reward={__name__}:fails_on_some_prompts"
    args = [*QUICK, reward, "rollout.max_prompt_retries=2", "num_steps=5"]
    with caplog.at_level(logging.WARNING):
        assert main(["train", *args, "--run-dir", str(run_dir)]) == 0
    lines = read_ledger(run_dir / "prompts.jsonl")
    fates: dict[int, list[tuple[str, str]]] = {}
    for line in lines:
        if line["epoch"] == 0:
            fates.setdefault(line["prompt_id"], []).append((line["outcome"], line["reason"]))
    few = "too few scored samples"
    assert fates[ALWAYS_FAILS] == [
        (RETRIED, few),
        (RETRIED, few),
        (DROPPED, f"retries exhausted ({few})"),
    ]
    assert fates[FAILS_ONCE] == [(RETRIED, few), (TRAINED, "")]
    assert all(fates[p] == [(TRAINED, "")] for p in (0, 2, 3, 5))
    report = check_exactly_once(run_dir / "prompts.jsonl", 6)
    assert report.ok and 0 in report.complete_epochs, report.summary()
    assert report.dropped[0] == [ALWAYS_FAILS]
    # every failed sample counted (all 4 of a failing group's), each drop counted; the reward's
    # failure logged once for the run, each drop once
    rows = records(run_dir)[1:]
    failed_groups = [x for x in lines if few in x["reason"]]
    exhausted = [x for x in lines if x["reason"].startswith("retries exhausted")]
    assert sum(r["rollout/reward_errors"] for r in rows) == 4 * len(failed_groups)
    assert sum(r["rollout/too_few_scored_groups"] for r in rows) == len(failed_groups)
    assert sum(r["rollout/retries_exhausted"] for r in rows) == len(exhausted)
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "rollout.reward failed (ValueError)" in m]) == 1
    assert len([m for m in messages if "retries exhausted" in m]) == len(exhausted)


def test_a_resume_undoes_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    """A run whose newest checkpoint was lost (as if it died after step 3, before saving it):
    the resumed run marks step 3 and the end-of-run lines undone, trains from step 3 again, and
    its live lines are exactly those of a run never interrupted."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    reward = f"rollout.reward={__name__}:fails_on_some_prompts"
    args = [*QUICK, reward, "checkpoint.interval_steps=2", "num_steps=4"]
    assert main(["train", *args, "--run-dir", str(straight)]) == 0
    assert main(["train", *args, "num_steps=3", "--run-dir", str(resumed)]) == 0
    shutil.rmtree(checkpoint_dir(resumed, 3))
    assert main(["train", *args, "--resume", "--run-dir", str(resumed)]) == 0
    lines = read_ledger(resumed / "prompts.jsonl")
    undone = [x for x in lines if x["outcome"] == UNDONE]
    assert {x["step"] for x in undone} == {3, 4}  # step 3, and the first run's pending lines
    assert all(x["reason"] == "trainer restarted from step 2" and "was" in x for x in undone)
    assert [x for x in lines if x["outcome"] != UNDONE] == read_ledger(straight / "prompts.jsonl")
    report = check_exactly_once(resumed / "prompts.jsonl", 6)
    assert report.ok, report.summary()


def test_min_scored_samples_is_checked_against_the_group_size(tmp_path: Path, capsys) -> None:
    run_dir = str(tmp_path / "r")
    args = ["train", *QUICK, "rollout.n_samples_per_prompt=2", "rollout.min_scored_samples=3"]
    assert main([*args, "--run-dir", run_dir]) == 2
    err = capsys.readouterr().err
    assert "min_scored_samples=3 exceeds rollout.n_samples_per_prompt=2" in err
