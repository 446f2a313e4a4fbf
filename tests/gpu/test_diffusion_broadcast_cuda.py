"""Diffusion `sync.transport: broadcast` on CUDA: the served engine on the trainer's GPU (a gloo
group carrying CUDA tensors) and on a second GPU (NCCL), full weights and LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from verst.cli import main  # noqa: E402
from verst.diffusion import model as tiny  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("engine_device", ["cuda:0", "cuda:1"])
def test_diffusion_trains_through_a_broadcast_group_on_cuda(
    tmp_path: Path, engine_device: str, lora_rank: int
) -> None:
    if engine_device == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spec = tiny.TinyDiffusionSpec(image_size=8, hidden_size=32, num_layers=1)
    tiny.create_tiny_diffusion(tmp_path / "tiny", spec, pretrain_steps=2, seed=0, log=print)
    run_dir = tmp_path / "run"
    argv = [
        "train",
        "examples/diffusion_flow_grpo.yaml",
        f"model.path={tmp_path / 'tiny'}",
        "num_steps=3",
        "trainer.device=cuda",
        "trainer.lr=1e-2",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "diffusion.num_inference_steps=4",
        "diffusion.eval_seeds_per_prompt=1",
        "diffusion.sde_window_range=[0,3]",
        "diffusion.engine=http",
        f"diffusion.engine_device={engine_device}",
        "sync.transport=broadcast",
        f"model.lora.rank={lora_rank}",
        "--run-dir",
        str(run_dir),
    ]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["weight_version"] for r in steps] == [1, 2, 3]
    assert all(r["sync/bytes"] > 0 for r in steps)
    # float32 on both sides; another GPU of the same kind runs the same kernels
    assert all(r["train/log_prob_mean_abs_diff"] < 1e-4 for r in steps)
