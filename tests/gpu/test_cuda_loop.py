"""The RL loop on CUDA: bf16 compute, copy-based colocated sync, metrics within bf16 tolerance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from verst.cli import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SMALL = [
    "num_steps=3",
    "trainer.device=cuda",
    "model.tiny={hidden_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 128, max_position_embeddings: 32}",
    "rollout.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "trainer.lr=1e-3",
    "eval.interval_steps=3",
    "eval.data.max_prompts=16",
    "eval.max_new_tokens=4",
    "loss.kl_loss_coef=0.01",
]


def test_loop_runs_on_cuda_in_bf16(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        # bf16 engine vs bf16 trainer forward: same weights, different kernels and batching
        assert row["train/train_rollout_logprob_abs_diff"] < 5e-2
        assert row["train/kl_loss"] >= 0.0


def test_engine_weights_equal_trainer_weights_after_sync() -> None:
    import copy

    from verst.engine import Scheduler
    from verst.models.tiny import TinyModelConfig, build_tiny_model
    from verst.sync.embedded import EmbeddedSync
    from verst.train.algorithms import LossConfig
    from verst.train.batching import TrainItem
    from verst.train.trainer import Trainer, TrainerConfig

    device = torch.device("cuda")
    model = build_tiny_model(
        TinyModelConfig(
            hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128
        ),
        vocab_size=40,
        seed=0,
    )
    engine = Scheduler.for_model(
        copy.deepcopy(model).to(device, torch.bfloat16).eval(),
        eos_token_ids=[0],
        pad_token_id=0,
        kv_cache_bytes=64 << 20,
    )
    trainer = Trainer(
        model,
        TrainerConfig(lr=1e-2, device="cuda"),
        LossConfig(),
        total_steps=2,
        pad_token_id=0,
        device=device,
    )
    sync = EmbeddedSync(trainer, engine)
    assert not sync.zero_copy  # fp32 master weights, bf16 engine
    batch = [
        TrainItem(
            tokens=[5, 6, 7, 8, 9],
            response_length=2,
            loss_mask=[1, 1],
            rollout_logprobs=[-1.0, -2.0],
            advantage=1.0,
        )
    ] * 4
    trainer.step(batch, step=1)
    sync.push(2)
    engine_params = dict(engine.model.named_parameters())
    for name, tensor in trainer.full_state_dict().items():
        if name in engine_params:
            assert torch.equal(engine_params[name].cpu(), tensor.to(torch.bfloat16)), name
    assert engine.weight_version == 2


@pytest.mark.parametrize(
    "overrides",
    [
        ["loss.advantage_estimator=ppo"],
        ["loss.advantage_estimator=gspo", "loss.use_tis=true"],
        [
            "loss.advantage_estimator=reinforce_plus_plus",
            "loss.kl_coef=0.01",
            "loss.kl_loss_coef=0.0",
            "loss.mis_level=sequence",
        ],
    ],
)
def test_objectives_run_on_cuda(tmp_path: Path, overrides: list[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, "num_steps=2", *overrides, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["train/loss"]) for r in rows[1:])
