"""`verst train` with model.kind: diffusion: fully asynchronous mode and `--resume`, end to end."""

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

from verst.cli import main  # noqa: E402
from verst.config import load_config  # noqa: E402
from verst.diffusion import model as tiny  # noqa: E402
from verst.diffusion import shapes  # noqa: E402

SPEC = tiny.TinyDiffusionSpec(image_size=8, hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("diffusion") / "tiny"
    tiny.create_tiny_diffusion(directory, SPEC, pretrain_steps=2, seed=0, log=lambda _: None)
    return directory


def overrides(model_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "diffusion.num_inference_steps=4",
        "diffusion.eval_seeds_per_prompt=1",
        "diffusion.eval_interval_steps=0",
        "diffusion.sde_window_range=[0,3]",
        *extra,
    ]


def train(model_dir: Path, run_dir: Path, *extra: str, resume: bool = False) -> list[dict]:
    argv = ["train", "examples/diffusion_flow_grpo.yaml", *overrides(model_dir, *extra)]
    assert main([*argv, "--run-dir", str(run_dir), *(["--resume"] if resume else [])]) == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_fully_async_trains_through_the_buffer_and_resumes(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    records = train(model_dir, run_dir, "mode=fully_async", "num_steps=2")
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["weight_version"] for r in steps] == [1, 2]
    for r in steps:  # the LM's worker and buffer fed the step
        assert r["buffer/taken_groups"] >= 2 and "perf/wait_time_s" in r
        assert 0 <= r["buffer/staleness_max"] <= 4
        assert 0 <= r["rollout/reward_mean"] <= 1 and r["train/transitions"] > 0
    records = train(model_dir, run_dir, "mode=fully_async", "num_steps=3", resume=True)
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3]
    assert records[-1]["weight_version"] == 3
    assert (run_dir / "checkpoints" / "step_000003" / "trainer_state.pt").is_file()


def test_resume_continues_as_the_uninterrupted_run(model_dir, tmp_path):
    whole = train(model_dir, tmp_path / "whole", "num_steps=2")
    train(model_dir, tmp_path / "cut", "num_steps=1")
    resumed = train(model_dir, tmp_path / "cut", "num_steps=2", resume=True)
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for key in ("train/loss", "rollout/reward_mean", "train/log_prob_mean_abs_diff"):
        assert resumed[-1][key] == whole[-1][key], key
    assert resumed[-1]["weight_version"] == whole[-1]["weight_version"] == 2


def test_resume_without_a_checkpoint_names_the_directory(model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(model_dir, run_dir, "num_steps=1")
    shutil.rmtree(run_dir / "checkpoints")
    argv = ["train", "examples/diffusion_flow_grpo.yaml", *overrides(model_dir, "num_steps=2")]
    assert main([*argv, "--run-dir", str(run_dir), "--resume"]) == 2
    assert "checkpoints holds no committed checkpoint" in capsys.readouterr().err


def test_fully_async_sft_is_refused(model_dir):
    with pytest.raises(ValueError, match="SFT has no rollout"):
        load_config(
            "examples/diffusion_flow_grpo.yaml",
            overrides(model_dir, "mode=fully_async", "diffusion.algorithm=sft"),
        )


def evaluated(checkpoint: Path, model_dir: Path, capsys) -> dict[str, float]:
    """`verst eval CHECKPOINT CONFIG` on a diffusion checkpoint: its table, row by row."""
    argv = ["eval", str(checkpoint), "examples/diffusion_flow_grpo.yaml", *overrides(model_dir)]
    capsys.readouterr()
    assert main(argv) == 0
    header, *rows = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["caption", "reward_mean"]
    return {row.rsplit(None, 1)[0]: float(row.rsplit(None, 1)[1]) for row in rows}


def test_eval_scores_a_checkpoint_as_the_run_did(model_dir, tmp_path, capsys):
    records = train(model_dir, tmp_path / "run", "num_steps=1", "trainer.lr=1e-2")
    table = evaluated(tmp_path / "run" / "checkpoints" / "step_000001", model_dir, capsys)
    assert list(table) == [*shapes.CAPTIONS, "all"]
    # the run's last evaluation: the same model, captions and held-out seeds
    assert table["all"] == pytest.approx(records[-1]["eval/reward_mean"], abs=1e-4)
    for caption in shapes.CAPTIONS:
        key = f"eval/{caption.replace(' ', '_')}/reward_mean"
        assert table[caption] == pytest.approx(records[-1][key], abs=1e-4)
    with pytest.raises(ValueError, match="eval.interval_steps: a diffusion run evaluates"):
        load_config(
            "examples/diffusion_flow_grpo.yaml", overrides(model_dir, "eval.interval_steps=2")
        )
