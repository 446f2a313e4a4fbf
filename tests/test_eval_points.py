"""The evaluation points' rules, each skip reason with its cause: the version check
(`version_mismatch`), a snapshot that never completes (`ckpt_missing`), an export that fails
(`export_failed`), an eval fleet that cannot be pinned (`pin_violation`) or is down
(`unhealthy`); garbage collection of exports only; pending points drain. Through `verst train`
in `tests/test_eval_modes.py`."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verst.eval.config import EvalConfig
from verst.eval.evaluate import Evaluator
from verst.eval.external import ExternalScorer
from verst.eval.fleet_eval import FleetScorer
from verst.eval.points import EvalPoints, attributed
from verst.eval.scores import group_sums, set_metrics
from verst.eval.snapshots import collect_garbage, snapshot_dir
from verst.fleet.fleet import Fleet
from verst.fleet.placement import PlacementConfig
from verst.models.tiny import TinyModelConfig, create_tiny
from verst.plugin_loader import PluginError
from verst.plugins import EvalSkip
from verst.rollout.rewards import RewardScorer, exact_match
from verst.train.checkpoint import COMPLETE_MARKER
from verst.types import Sample

EXTERNAL = dict(mode="external", interval_steps=1, function="tests.eval_functions:files_seen")


def sample(*versions: int) -> Sample:
    return Sample(prompt="", weight_versions=list(versions), reward=1.0, response_length=2)


def test_a_point_is_valid_only_if_every_sample_is_of_the_steps_version_alone() -> None:
    def metrics(*groups: list[Sample]) -> dict[str, float]:
        return set_metrics(group_sums(list(groups), 2), "eval")

    good = metrics([sample(7), sample(7)], [sample(7), sample(7)])
    assert good["eval/mixed_version_ratio"] == 0 and good["eval/weight_version/mean"] == 7
    assert attributed(good, 7) == good

    mixed = metrics([sample(6, 7), sample(7)], [sample(7), sample(7)])
    assert mixed["eval/mixed_version_ratio"] == 0.25
    skip = attributed(mixed, 7)
    assert skip["eval/skipped_version_mismatch"] == 1 and "eval/accuracy" not in skip
    assert "25%" in skip["eval/skip_detail"]

    older = attributed(metrics([sample(6), sample(6)]), 7)
    assert older["eval/skipped_version_mismatch"] == 1 and "6.0, not 7" in older["eval/skip_detail"]
    unknown = attributed(metrics([sample(), sample(7)]), 7)  # a sample with no version
    assert unknown["eval/skipped_version_mismatch"] == 1


def points(tmp_path: Path, scorer, *, export=None, checkpoint_due=None, **cfg) -> EvalPoints:
    return EvalPoints(
        EvalConfig(**(EXTERNAL | cfg)),
        run_dir=tmp_path,
        evaluator=None,
        engine=None,  # type: ignore[arg-type]  (snapshot points never use the rollout's)
        paused=contextlib.nullcontext,
        checkpoint_due=checkpoint_due or (lambda step, last: False),
        export=export,
        scorer=scorer,
    )


def export_to(run_dir: Path, step: int) -> Path:
    out = snapshot_dir(run_dir, step)
    out.mkdir(parents=True)
    (out / COMPLETE_MARKER).touch()
    return out


def test_snapshot_points_skip_with_their_reason_and_pending_ones_drain(tmp_path: Path) -> None:
    def score(path: Path, step: int, version: int) -> dict[str, float]:
        time.sleep(0.2)
        return {"eval/score": float(step)}

    def export(run_dir: Path, step: int) -> Path:
        if step == 1:
            raise OSError(28, "No space left on device")
        return export_to(run_dir, step)

    due = lambda step, last: step == 2  # noqa: E731 (the checkpoint of step 2 is reused)
    evals = points(tmp_path, score, export=export, checkpoint_due=due, snapshot_timeout_s=0.3)
    for step in range(4):
        assert evals.at_step(step, 10 + step, last=step == 3) == {}  # the trainer goes on
    records = {r["step"]: r for r in evals.finished(wait=True)}  # every pending point ends
    evals.close(drain=True)
    assert sorted(records) == [0, 1, 2, 3]
    assert records[0]["eval/score"] == 0 and records[3]["eval/score"] == 3
    assert records[1]["eval/skipped_export_failed"] == 1
    assert "No space left" in records[1]["eval/skip_detail"]
    # step 2's checkpoint never got its .complete marker
    assert records[2]["eval/skipped_ckpt_missing"] == 1 and "eval/score" not in records[2]
    assert records[3]["eval/weight_version"] == 13 and records[3]["eval/lag_steps"] == 0


def test_garbage_collection_removes_only_its_own_older_exports(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        export_to(tmp_path, step)
    mine = tmp_path / "eval_snapshots" / "notes"
    mine.mkdir()
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    busy = {snapshot_dir(tmp_path, 2)}  # still to be evaluated
    removed = collect_garbage(tmp_path, keep=2, busy=busy)
    assert removed == [snapshot_dir(tmp_path, 4)]
    left = sorted(p.name for p in (tmp_path / "eval_snapshots").iterdir())
    assert left == ["notes", "step_000002", "step_000006", "step_000008"]
    assert checkpoint.is_dir()


@pytest.fixture
def tiny_fleet(tmp_path: Path):
    model_dir = tmp_path / "model"
    shape = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    create_tiny(model_dir, TinyModelConfig(**shape))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fleet = Fleet.start(
        PlacementConfig(engines="in_process", num_engines=1),
        model=model,
        tokenizer=tokenizer,
        model_dir=model_dir,
        trainer_device=torch.device("cpu"),
        dtype=torch.float32,
        seed=0,
    )
    yield fleet, model_dir, tokenizer
    fleet.close()


def test_the_eval_fleet_is_pinned_to_the_snapshot_or_the_point_is_skipped(
    tmp_path: Path, tiny_fleet
) -> None:
    from verst.engine import SamplingParams

    fleet, model_dir, tokenizer = tiny_fleet
    prompts = [Sample(prompt="1+2=", tokens=tokenizer.encode("1+2="), label="3")]
    evaluator = Evaluator(
        SamplingParams(max_new_tokens=2),
        2,
        prompts,
        RewardScorer(exact_match, timeout_s=None),
        tokenizer.decode,
        torch.device("cpu"),
        sharded=False,
    )
    scorer = FleetScorer(fleet, evaluator, prompts[0].prompt_tokens, pin_timeout_s=60)
    metrics = scorer(model_dir, 3, 41)
    assert metrics["eval/weight_version/mean"] == 41 and metrics["eval/num_prompts"] == 1
    assert metrics["eval/mixed_version_ratio"] == 0

    broken = tmp_path / "broken"  # the engine cannot load it: no weights are scored from it
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(EvalSkip) as skip:
        scorer(broken, 4, 42)
    assert skip.value.reason == "pin_violation"

    engine = fleet.clients[0].serving  # type: ignore[attr-defined]
    fleet.wait(engine.stop())
    with pytest.raises(EvalSkip) as skip:
        scorer(model_dir, 5, 43)
    assert skip.value.reason == "unhealthy"


def test_an_evaluation_thread_that_waits_never_holds_the_trainer(tmp_path: Path) -> None:
    """`max_in_flight` 1 with `overflow: skip`: a busy point is skipped at once, the last one
    waits for room."""
    release = threading.Event()

    def score(path: Path, step: int, version: int) -> dict[str, float]:
        release.wait(10)
        return {"eval/score": 1.0}

    evals = points(
        tmp_path, score, export=export_to, max_in_flight=1, overflow="skip", keep_snapshots=5
    )
    started = time.monotonic()
    evals.at_step(0, 1)
    evals.at_step(1, 2)  # busy: skipped, not waited for
    assert time.monotonic() - started < 1.0
    threading.Timer(0.3, release.set).start()
    evals.at_step(2, 3, last=True)  # the last point waits for room
    records = {r["step"]: r for r in evals.finished(wait=True)}
    evals.close(drain=True)
    assert records[1]["eval/skipped_busy"] == 1
    assert records[0]["eval/score"] == 1 and records[2]["eval/score"] == 1


def test_a_function_its_process_cannot_import_stops_the_run_at_start() -> None:
    path = "tests.eval_functions_parent_only:score"
    message = rf"eval\.function: {path} cannot be loaded in its process"
    with pytest.raises(PluginError, match=message):
        ExternalScorer(path, [], nice=0)
