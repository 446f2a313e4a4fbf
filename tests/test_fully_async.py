"""Fully asynchronous RL end to end: two engine processes generate while the trainer trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_ledger import ALWAYS_FAILS, FAILS_ONCE
from tests.test_loop import SMALL, records
from verst.cli import main
from verst.rollout.ledger import PENDING, TRAINED, check_exactly_once, read_ledger
from verst.train.checkpoint import list_checkpoints, load_checkpoint

pytest.importorskip("aiohttp")

ASYNC = [
    "mode=fully_async",
    "placement.engines=processes",
    "placement.mode=disaggregated",
    "placement.num_engines=2",
    "placement.engine_threads=1",
    "num_steps=6",
    "rollout.max_staleness=2",
    "rollout.buffer_factor=2",
]


@pytest.mark.slow
def test_fully_async_run_on_two_engine_processes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # unused=drop: the data source gets no prompts back, so what its saved state holds to
    # serve again is exactly what the worker held at the checkpoint. The reward fails on two
    # of the 12 prompts, so the worker sets their groups aside (dropped, with unused=drop).
    overrides = [
        *SMALL,
        *ASYNC,
        "rollout.unused=drop",
        "data.max_prompts=12",
        "rollout.reward=tests.test_ledger:fails_on_some_prompts",
    ]
    assert main(["train", *overrides, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == list(range(7))
    versions = [r["weight_version"] for r in rows]
    assert versions == list(range(versions[0], versions[0] + 7))
    for row in rows[1:]:
        assert row["buffer/capacity"] == 8
        assert 0 <= row["buffer/queue_size"] <= row["buffer/capacity"]
        # what the trainer consumed was never staler than the bound
        assert row["buffer/staleness_max"] <= 2
        assert row["rollout/inflight_peak"] <= 16  # one step's worth by default
        assert row["train/train_rollout_logprob_abs_diff"] >= 0
        assert row["sync/resent_engines"] == 0
    # generation ran ahead of the trainer: some consumed groups came from older weights
    assert max(r["buffer/staleness_max"] for r in rows[1:]) >= 1
    # and none went stale: a take waits for the groups due at it (rollout.wait_for_due)
    assert rows[-1]["buffer/dropped_stale"] == 0
    assert all(r["buffer/due_wait_s"] >= 0 and r["buffer/due_groups"] >= 0 for r in rows[1:])
    assert (
        rows[-1]["buffer/generated_response_len_max"]
        >= rows[-1]["buffer/generated_response_len_p50"]
    )
    assert "eval/accuracy" in rows[-1]
    # the last checkpoint was saved while groups were generating or buffered: their prompts
    # are in its data state, to be served first by a resumed run
    _, state = load_checkpoint(list_checkpoints(run_dir)[-1])
    pending = state["data"]["returned"]
    # at most a group per in-flight place (replacement=sample: a group may hold just one, for
    # its last trajectory) and a full buffer
    assert 1 <= len(pending) <= 16 + 8
    # the ledger: every group taken trained once, the failing prompts dropped, the groups the
    # worker still held at the end pending
    lines = read_ledger(run_dir / "prompts.jsonl")
    trained = [(x["epoch"], x["prompt_id"]) for x in lines if x["outcome"] == TRAINED]
    assert len(trained) == 6 * 4 == len(set(trained))
    dropped = {x["prompt_id"] for x in lines if x["reason"] == "too few scored samples"}
    assert dropped == {ALWAYS_FAILS, FAILS_ONCE}
    assert any(x["outcome"] == PENDING for x in lines)
    report = check_exactly_once(run_dir / "prompts.jsonl", 12)
    assert report.ok and report.complete_epochs, report.summary()
    assert sum(r["rollout/reward_errors"] for r in rows[1:]) >= 2 * 4
