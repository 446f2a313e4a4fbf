"""End to end through the public CLI: a few RL steps, resume, NaN handling, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from verst.cli import main
from verst.train.checkpoint import list_checkpoints, load_checkpoint

SMALL = [
    "num_steps=4",
    "trainer.device=cpu",  # these tests check fp32 CPU numerics, also on a GPU machine
    "num_threads=1",
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 64, max_position_embeddings: 32}",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "trainer.lr=1e-3",
    "warm_start.enabled=true",
    "warm_start.max_steps=2",
    "warm_start.batch_size=8",
    "warm_start.check_interval_steps=1",
    "warm_start.target_accuracy=1.0",
    "warm_start.dev_data.max_prompts=8",
    "eval.interval_steps=2",
    "eval.data.max_prompts=8",
    "eval.max_new_tokens=4",
    "checkpoint.interval_steps=2",
    "checkpoint.keep_last=3",
]
REQUIRED = (
    "step",
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "train/loss",
    "train/grad_norm",
    "train/train_rollout_logprob_abs_diff",
    "perf/step_time_s",
    "weight_version",
)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_smoke_run_writes_metrics_checkpoints_and_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert "eval/accuracy" in rows[0] and rows[0]["warm_start/steps"] == 2
    for row in rows[1:]:
        assert all(key in row for key in REQUIRED), row.keys()
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-4
    # the warm start's two dev checks installed versions 1 and 2
    assert [r["weight_version"] for r in rows] == [3, 4, 5, 6, 7]
    assert all("eval/accuracy" in rows[i] for i in (2, 4))
    # the embedded engine's metrics: steps 2 and 4 follow a step without eval, so they count
    # exactly the rollout's 4 x 4 requests
    for row in (rows[2], rows[4]):
        assert row["engine/scheduler_requests"] == 16
        assert row["engine/generation_tokens"] == round(16 * row["rollout/response_len_mean"])
    assert all(r["engine/weight_version"] == r["weight_version"] for r in rows[1:])
    # every phase of a step is timed; eval and checkpoint only on the steps that ran them
    phases = ("rollout", "reward", "advantages", "train", "sync")
    for row in rows[1:]:
        times = {p: row[f"perf/{p}_time_s"] for p in phases}
        assert all(t >= 0 for t in times.values())
        assert row["perf/step_time_s"] == pytest.approx(sum(times.values()))
        assert (
            ("perf/eval_time_s" in row)
            == ("perf/checkpoint_time_s" in row)
            == (row["step"] % 2 == 0)
        )
    assert (run_dir / "config.yaml").is_file()
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000002", "step_000004"]
    # a checkpoint is an HF directory any loader reads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(list_checkpoints(run_dir)[-1])
    AutoTokenizer.from_pretrained(list_checkpoints(run_dir)[-1])


def test_resume_continues_exactly(tmp_path: Path) -> None:
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert main(["train", *SMALL, "--run-dir", str(straight)]) == 0
    assert main(["train", *SMALL, "num_steps=2", "--run-dir", str(interrupted)]) == 0
    # the resumed run must see the same data order and sampling randomness
    assert main(["train", *SMALL, "--run-dir", str(interrupted), "--resume"]) == 0
    a, b = records(straight), records(interrupted)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss"):
        assert [r[key] for r in a[1:]] == pytest.approx([r[key] for r in b[1:]], abs=1e-6), key
    final_a, _ = load_checkpoint(list_checkpoints(straight)[-1])
    final_b, _ = load_checkpoint(list_checkpoints(interrupted)[-1])
    for name, tensor in final_a.items():
        torch.testing.assert_close(final_b[name], tensor, atol=1e-6, rtol=1e-5)


def test_refuses_to_overwrite_a_run(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, "num_steps=1", "--run-dir", str(run_dir)]) == 0
    assert main(["train", *SMALL, "num_steps=1", "--run-dir", str(run_dir)]) == 2
    assert "--resume" in capsys.readouterr().err


def test_nan_loss_stops_names_the_step_and_keeps_a_good_checkpoint(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Fault injection: the loss turns NaN at step 3 (as after a numerical blow-up)."""
    import verst.train.trainer as trainer_module

    real = trainer_module.policy_objective
    calls = []

    def blow_up(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the third RL step (one micro-batch per step)
            loss = loss * float("nan")
        return loss, stats

    monkeypatch.setattr(trainer_module, "policy_objective", blow_up)
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, "checkpoint.interval_steps=0", "--run-dir", str(run_dir)]) == 4
    err = capsys.readouterr().err
    assert "step 3" in err and "step_000002" in err
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000002"]
    assert [r["step"] for r in records(run_dir)] == [0, 1, 2]


def test_malformed_jsonl_names_file_and_line(tmp_path: Path, capsys) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": oops}\n')
    code = main(["train", *SMALL, f"data.path={data}", "--run-dir", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert "prompts.jsonl" in err and ":2" in err or "line 2" in err


def torchrun_module(module: str, args: list[str], nproc: int = 2) -> None:
    """`python -m MODULE ARGS` under torchrun with `nproc` ranks (gloo on the CPU); asserts
    success."""
    import os
    import subprocess
    import sys

    from verst.fleet.launcher import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), "-m", module, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"


def torchrun_train(args: list[str], run_dir: Path, nproc: int = 2, command: str = "train") -> None:
    """`verst COMMAND ARGS` under torchrun with `nproc` ranks; asserts success."""
    torchrun_module("verst", [command, *args, "--run-dir", str(run_dir)], nproc)


def test_torchrun_two_ranks_on_gloo(tmp_path: Path) -> None:
    """Two trainer ranks (FSDP2 over gloo), each with its own engine and share of the batch.

    The reward fails on two prompts (whichever rank draws them), so their prompts go back to
    be served again: every rank's data source must take them back, or the ranks would draw
    different prompts from then on. The ledger (rank 0's, of both ranks' groups) must show
    the fates a single process shows, step by step."""
    from verst.rollout.ledger import check_exactly_once, read_ledger

    run_dir, single = tmp_path / "run", tmp_path / "single"
    args = [
        *SMALL,
        "num_steps=3",
        "data.max_prompts=6",
        "rollout.reward=tests.test_ledger:fails_on_some_prompts",
    ]
    torchrun_train(args, run_dir)
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["rollout/num_samples"] == 16  # both ranks' samples counted once
    assert rows[2]["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000002", "step_000003"]
    assert main(["train", *args, "--run-dir", str(single)]) == 0

    def fates(path: Path) -> list[set]:
        by_step: dict[int, set] = {}
        for x in read_ledger(path / "prompts.jsonl"):
            by_step.setdefault(x["step"], set()).add(tuple(sorted(x.items())))
        return [by_step[step] for step in sorted(by_step)]

    assert fates(run_dir) == fates(single)
    assert sum(r["rollout/reward_errors"] for r in rows[1:]) > 0
    report = check_exactly_once(run_dir / "prompts.jsonl", 6)
    assert report.ok and report.complete_epochs == [0], report.summary()


def reward_one(sample: object) -> float:
    return 1.0


@pytest.mark.slow
def test_torchrun_reference_and_critic_start_from_the_warm_started_policy(tmp_path: Path) -> None:
    """Two FSDP2 ranks, a warm start, then PPO with a KL loss: a full state dict is rank 0's
    alone, so the reference and the critic's body reach rank 1 by broadcast (rank 1 had an empty
    one and stopped); the critic's value head, in its root's parameter group, is unsharded for
    its backward (it was read freed: "setStorage ... storage of size 0")."""
    run_dir = tmp_path / "run"
    args = [*SMALL, "loss.kl_loss_coef=0.1", "loss.entropy_coef=0.05", "num_steps=2"]
    args += ["loss.advantage_estimator=ppo", "rollout.reward=tests.test_loop:reward_one"]
    torchrun_train([*args, "eval.interval_steps=0"], run_dir)
    rows = records(run_dir)
    assert rows[0]["warm_start/steps"] >= 1  # its dev check scores with reward_one: 1 step
    assert [r["step"] for r in rows if r.get("train/kl_loss", 0) > 0] == [2]
    # every return is 1 and the zero head starts every value at 0; then the values move
    assert rows[1]["train/value_loss"] > 0 and rows[1]["train/critic_grad_norm"] > 0
    assert rows[1]["train/values_mean"] == 0 < rows[2]["train/values_mean"]


def test_custom_data_and_reward_example_runs(tmp_path: Path, monkeypatch) -> None:
    """examples/times_tables.yaml: a JSONL file and a reward named by import path."""
    repo = Path(__file__).parent.parent
    monkeypatch.chdir(repo)
    run_dir = tmp_path / "run"
    args = [
        "train",
        "examples/times_tables.yaml",
        "num_steps=2",
        "trainer.device=cpu",
        "warm_start.max_steps=1",
        "warm_start.check_interval_steps=1",
        "eval.data.max_prompts=8",
        "--run-dir",
        str(run_dir),
    ]
    assert main(args) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert 0.0 <= rows[1]["rollout/reward_mean"] <= 1.0


def test_aborted_and_failed_samples_leave_their_group_before_advantages() -> None:
    from verst.loop import only_scored, train_items
    from verst.train.algorithms import LossConfig
    from verst.types import Sample, Status

    def sample(group: int, reward: float, status: Status = Status.COMPLETED) -> Sample:
        return Sample(
            tokens=[1, 2, 3],
            response_length=1,
            loss_mask=[1],
            rollout_logprobs=[-1.0],
            reward=reward,
            status=status,
            group_index=group,
        )

    groups = [
        [
            sample(0, 1.0),
            sample(0, 0.0),
            sample(0, 0.0, Status.ABORTED),
            sample(0, 0.0, Status.FAILED),  # its reward function raised
        ],
        [sample(1, 0.0, Status.ABORTED), sample(1, 0.0, Status.FAILED)],
    ]
    kept = only_scored(groups)
    assert [len(g) for g in kept] == [2]
    # Dr.GRPO advantage = reward − group mean over the scored attempts: mean 0.5, not 1/4
    items = train_items(kept, LossConfig(advantage_estimator="dr_grpo"))
    assert [item.advantage for item in items] == [0.5, -0.5]
