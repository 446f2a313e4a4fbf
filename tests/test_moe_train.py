"""R3 end to end: `examples/moe.yaml` (a tiny Qwen3-MoE, routing replay on) through `verst
train`, shortened, in one process and under torchrun (FSDP2 over gloo, two ranks); routing
replay with a dense tiny model refused before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_loop import records, torchrun_train
from verst.cli import main

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "moe.yaml")
SHORT = [
    "num_steps=3",
    "num_threads=1",
    "trainer.device=cpu",
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=2",
    "model.tiny.num_heads=2",
    "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=64",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "warm_start.enabled=false",
    "eval.interval_steps=0",
    "checkpoint.interval_steps=0",
]


def check_replayed(run_dir: Path) -> None:
    rows = [r for r in records(run_dir) if "train/routing_agreement" in r]
    assert len(rows) == 3
    for row in rows:
        assert 0.0 < row["train/routing_agreement"] <= 1.0
        assert "train/train_rollout_logprob_abs_diff_no_replay" in row
        # fp32 on one machine: the engine's routing is the trainer's, replayed or not
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-4


@pytest.mark.slow
def test_moe_example_trains_with_routing_replay(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", EXAMPLE, *SHORT, "--run-dir", str(run_dir)]) == 0
    check_replayed(run_dir)


@pytest.mark.slow
def test_moe_with_routing_replay_under_torchrun(tmp_path: Path) -> None:
    torchrun_train([EXAMPLE, *SHORT], tmp_path / "run")
    check_replayed(tmp_path / "run")


def test_routing_replay_with_a_dense_model_is_refused(tmp_path: Path, capsys) -> None:
    code = main(["train", EXAMPLE, "model.tiny.family=qwen3", "--run-dir", str(tmp_path / "r")])
    assert code == 2
    assert "model.tiny.family 'qwen3' is dense" in capsys.readouterr().err
