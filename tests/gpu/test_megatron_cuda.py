"""The megatron backend on CUDA: at TP = PP = EP = 1 on one GPU its bf16 log-probs match the
HF (FSDP2) forward within bf16 tolerance, a GRPO step, a KL-loss step against a frozen
reference, a KL-reward step and an SFT step run (`tests/gpu/megatron_parallel.py`), and a
few GRPO steps (warm start and KL reference included) and an SFT run go through `verst`; on a
pair, TP = 2, PP = 2 and (Qwen3-MoE) EP = 2 each run the same under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16_LOGPROB_ATOL = 0.05  # bf16 compute of fp32 master weights, tiny model


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_one_gpu_logprobs_match(family: str, tmp_path: Path) -> None:
    _torchrun(1, [1, 1, 1], family, tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    ("layout", "family"), [([2, 1, 1], "qwen3"), ([1, 2, 1], "qwen3"), ([1, 1, 2], "qwen3-moe")]
)
def test_pair_layouts(layout: list[int], family: str, tmp_path: Path) -> None:
    _torchrun(2, layout, family, tmp_path)


def _torchrun(gpus: int, layout: list[int], family: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}",
               "-m", "tests.gpu.megatron_parallel",
               *map(str, layout), family, str(out)]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    print(f"layout {layout} {family}: max |Δ logprob| = {result['max_logprob_diff']:.4f}")
    assert result["max_logprob_diff"] < BF16_LOGPROB_ATOL
    assert torch.isfinite(torch.tensor(result["loss"]))
    assert "model.embed_tokens.weight" in result["names"]
    print(f"  kl_loss {result['kl_loss']:.3g}, sft loss {result['sft_loss']:.4f}")
    assert result["kl_loss"] > 0  # the policy moved off the reference in step 1
    for key in ("kl_reward_loss", "sft_loss", "sft_grad_norm", "eval_loss"):
        assert torch.isfinite(torch.tensor(result[key])), key
    assert result["sft_grad_norm"] > 0


def test_verst_train_grpo_steps(tmp_path: Path) -> None:
    from verst.cli import main

    args = ["train", "num_steps=3", "trainer.backend=megatron", "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4", "trainer.lr=1e-3",
            "model.tiny={hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2, "
            "intermediate_size: 128, max_position_embeddings: 32}",
            "data.task=addition", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if "train/loss" in line]
    assert len(steps) == 3


def test_verst_train_warm_start_and_kl_reference(tmp_path: Path) -> None:
    from verst.cli import main

    args = ["train", "num_steps=3", "trainer.backend=megatron", "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4", "trainer.lr=1e-3",
            "warm_start.enabled=true", "warm_start.max_steps=4", "warm_start.batch_size=16",
            "warm_start.dev_data.max_prompts=16", "loss.kl_loss_coef=0.1",
            "loss.entropy_coef=0.05", "eval.interval_steps=0",
            "model.tiny={hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2, "
            "intermediate_size: 128, max_position_embeddings: 32}",
            "data.task=addition", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert rows[0]["warm_start/steps"] >= 1
    assert [r["step"] for r in rows if "train/kl_loss" in r] == [1, 2, 3]


def test_verst_sft_on_megatron(tmp_path: Path) -> None:
    from verst.cli import main

    args = ["sft", "examples/sft.yaml", "trainer.backend=megatron", "sft.max_steps=4",
            "sft.batch_size=32", "sft.eval_interval_steps=2", "sft.eval_data.max_prompts=32",
            "checkpoint.interval_steps=4", "--run-dir", str(tmp_path / "sft")]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[-1]["eval/loss"] < rows[0]["eval/loss"]
