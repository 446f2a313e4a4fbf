"""Every objective runs through `verst train`: estimators, corrections, aggregations, critic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.test_loop import SMALL
from verst.cli import main
from verst.train.checkpoint import list_checkpoints, load_checkpoint


def run(tmp_path: Path, *overrides: str, name: str = "run", resume: bool = False) -> list[dict]:
    run_dir = tmp_path / name
    args = ["train", *SMALL, *overrides, "--run-dir", str(run_dir)]
    assert main(args + (["--resume"] if resume else [])) == 0
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("overrides", "expected_keys"),
    [
        (["loss.advantage_estimator=dr_grpo", "loss.loss_aggregation=constant"], []),
        (["loss.advantage_estimator=gspo", "loss.loss_aggregation=seq_mean"], []),
        (
            ["loss.advantage_estimator=reinforce_plus_plus", "loss.kl_coef=0.01", "loss.gamma=0.9"],
            [],
        ),
        (["loss.advantage_estimator=reinforce_plus_plus_baseline"], []),
        (
            ["loss.advantage_estimator=ppo", "loss.lam=0.95", "trainer.critic_lr=1e-3"],
            ["train/value_loss", "train/values_mean", "train/critic_grad_norm"],
        ),
        (
            [
                "loss.advantage_estimator=examples.custom_algorithm:RLOO",
                "loss.policy_loss=examples.custom_algorithm:unclipped_policy_gradient",
            ],
            [],
        ),
        (
            ["loss.use_tis=true", "loss.eps_clip_c=3.0"],
            ["train/tis_mean", "train/tis_clipfrac", "train/ess_ratio"],
        ),
        (
            ["loss.mis_level=geometric", "loss.mis_mode=mask"],
            ["train/mis_mean", "train/mis_masked_frac", "train/ess_ratio"],
        ),
        (
            ["loss.kl_loss_coef=0.05", "loss.kl_loss_type=low_var_kl", "loss.entropy_coef=0.01"],
            ["train/kl_loss", "train/entropy"],
        ),
    ],
)
def test_objective_trains_end_to_end(
    tmp_path: Path, overrides: list[str], expected_keys: list[str]
) -> None:
    rows = run(tmp_path, "num_steps=2", "eval.interval_steps=0", *overrides)
    for row in rows[1:]:
        for key in ["train/loss", "train/train_rollout_kl", *expected_keys]:
            assert key in row, key
            assert math.isfinite(row[key]), (key, row[key])


def test_ppo_resume_restores_the_critic_exactly(tmp_path: Path) -> None:
    ppo = ["loss.advantage_estimator=ppo", "eval.interval_steps=0"]
    straight = run(tmp_path, *ppo, name="straight")
    run(tmp_path, *ppo, "num_steps=2", name="interrupted")
    resumed = run(tmp_path, *ppo, name="interrupted", resume=True)
    for key in ("train/loss", "train/value_loss"):
        assert [r[key] for r in straight[1:]] == pytest.approx(
            [r[key] for r in resumed[1:]], abs=1e-6
        )
    (_, a), (_, b) = (
        load_checkpoint(list_checkpoints(tmp_path / n)[-1]) for n in ("straight", "interrupted")
    )
    for name, tensor in a["trainer"]["critic"]["weights"].items():
        torch.testing.assert_close(
            b["trainer"]["critic"]["weights"][name], tensor, atol=1e-6, rtol=1e-5
        )
