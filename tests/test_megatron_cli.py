"""The megatron backend through the public CLI: `mode: sft`, RL with a warm start and a KL
reference (resumed), and every weight transport to in-process and engine-process fleets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_loop import SMALL
from verst.cli import main
from verst.train.checkpoint import list_checkpoints

pytest.importorskip("megatron.core")
MEGATRON = ["trainer.backend=megatron", "trainer.device=cpu", "num_threads=1"]
TINY = (
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 64, max_position_embeddings: 32}"
)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_verst_train_sft_example_on_megatron_learns_and_resumes(tmp_path: Path) -> None:
    """`examples/sft.yaml` (mode: sft) on the megatron backend: the held-out loss falls, and a
    run stopped at step 2 and resumed logs the uninterrupted run's losses."""
    quick = [
        TINY, "sft.batch_size=16", "sft.eval_interval_steps=2", "sft.eval_data.max_prompts=16",
        "checkpoint.interval_steps=2", "trainer.lr_schedule=constant", "trainer.lr_warmup_steps=0",
    ]  # fmt: skip

    def run(name: str, *extra: str) -> list[dict]:
        args = ["train", "examples/sft.yaml", *MEGATRON, *quick, *extra]
        assert main([*args, "--run-dir", str(tmp_path / name)]) == 0
        return records(tmp_path / name)

    whole = run("whole", "sft.max_steps=4")
    assert [r["step"] for r in whole] == [0, 1, 2, 3, 4]
    assert all(r["sft/tokens"] > 0 and r["train/grad_norm"] > 0 for r in whole[1:])
    assert whole[-1]["eval/loss"] < whole[0]["eval/loss"]  # it learns
    assert list_checkpoints(tmp_path / "whole")  # an HF model directory RL can start from
    run("cut", "sft.max_steps=2")
    resumed = run("cut", "sft.max_steps=4", "--resume")
    for key in ("sft/loss", "train/grad_norm"):
        assert [r[key] for r in resumed if key in r] == pytest.approx(
            [r[key] for r in whole if key in r], rel=1e-6
        ), key


def test_warm_start_kl_reference_and_resume_on_megatron(tmp_path: Path) -> None:
    """Warm start, then GRPO with a KL loss to the policy as RL began; a run stopped after two
    steps and resumed (the reference read back from run_dir/reference) continues as the
    uninterrupted run does."""
    # the tiny model earns no reward yet: the entropy bonus moves it away from the reference
    kl = [*SMALL, *MEGATRON, "loss.kl_loss_coef=0.1", "loss.entropy_coef=0.05"]
    kl += ["eval.interval_steps=0"]

    def run(name: str, *extra: str) -> list[dict]:
        assert main(["train", *kl, *extra, "--run-dir", str(tmp_path / name)]) == 0
        return records(tmp_path / name)

    straight = run("straight")
    assert straight[0]["warm_start/steps"] == 2
    assert straight[-1]["train/kl_loss"] > 0
    run("interrupted", "num_steps=2")
    resumed = run("interrupted", "--resume")
    for key in ("train/loss", "train/kl_loss", "train/grad_norm"):
        assert [r[key] for r in resumed[1:]] == pytest.approx(
            [r[key] for r in straight[1:]], rel=1e-4, abs=1e-7
        ), key


ENGINE_PROCESSES = ["placement.engines=processes", "placement.engine_threads=1"]


@pytest.mark.parametrize(
    "transport",
    [
        ["placement.engines=in_process", "sync.transport=colocated"],
        ["placement.engines=in_process", "sync.transport=disk"],
        pytest.param([*ENGINE_PROCESSES, "sync.transport=broadcast"], marks=pytest.mark.slow),
        pytest.param([*ENGINE_PROCESSES, "sync.transport=colocated"], marks=pytest.mark.slow),
    ],
    ids=["in_process-copy", "in_process-disk", "processes-broadcast", "processes-shm"],
)
def test_every_transport_delivers_megatron_weights(tmp_path: Path, transport: list[str]) -> None:
    """The engines' log-probs equal the trainer's (the Megatron forward, fp32) after each
    push: the transport delivered the exported HF weights."""
    run_dir = tmp_path / "run"
    quick = ["num_steps=2", "warm_start.enabled=false", "eval.interval_steps=0", "sync.bucket_mb=1"]
    args = ["train", *SMALL, *MEGATRON, *quick, *transport, "--run-dir", str(run_dir)]
    assert main(args) == 0
    rows = records(run_dir)[1:]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-5, row
        assert row["sync/bytes"] > 0 and row["sync/resent_engines"] == 0, row
