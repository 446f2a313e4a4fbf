"""`verst model create-tiny-diffusion` then `verst train` with model.kind: diffusion, end to end."""

import json

import pytest

pytest.importorskip("diffusers")

from verst.cli import main  # noqa: E402
from verst.diffusion import model as tiny  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "engine", "lora_rank"),
    [("flow_grpo", "http", 0), ("nft", "in_process", 0), ("flow_grpo", "http", 4)],
)
def test_cli_trains_a_tiny_diffusion_model(tmp_path, algorithm, engine, lora_rank):
    model_dir = tmp_path / "tiny"
    argv = [
        "model",
        "create-tiny-diffusion",
        str(model_dir),
        "--image-size",
        "8",
        "--hidden-size",
        "32",
        "--num-layers",
        "1",
        "--pretrain-steps",
        "2",
    ]
    assert main(argv) == 0
    example = f"examples/diffusion_{'nft' if algorithm == 'nft' else 'flow_grpo'}.yaml"
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={model_dir}",
        "num_steps=2",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "diffusion.num_inference_steps=4",
        "diffusion.eval_seeds_per_prompt=1",
        "diffusion.sde_window_range=[0,3]",
        f"diffusion.engine={engine}",
        f"model.lora.rank={lora_rank}",
    ]
    assert main(["train", example, *overrides, "--run-dir", str(run_dir)]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > 0 and "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and steps[-1]["weight_version"] == 2
    assert all(0 <= r["rollout/reward_mean"] <= 1 for r in steps)
    if algorithm == "flow_grpo":
        assert all(r["train/log_prob_mean_abs_diff"] < 1e-5 for r in steps)
    assert (run_dir / "samples_step0.png").is_file() and (run_dir / "samples_step2.png").is_file()
    saved = "adapter" if lora_rank else "transformer"  # with LoRA the adapters alone
    assert (run_dir / "checkpoints" / "step_000002" / saved).is_dir()
    if lora_rank and engine == "http":  # the served engine got the adapters through the disk
        full_bytes = sum(p.numel() * 4 for p in tiny.load(model_dir)[0].parameters())
        assert 0 < steps[-1]["sync/bytes"] < full_bytes / 4
        assert sorted(p.name for p in (run_dir / "sync").iterdir()) == ["adapter"]


def test_cli_refuses_a_missing_model_dir(tmp_path, capsys):
    argv = [
        "train",
        "examples/diffusion_flow_grpo.yaml",
        f"model.path={tmp_path / 'none'}",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    assert main(argv) == 2
    assert "create-tiny-diffusion" in capsys.readouterr().err
