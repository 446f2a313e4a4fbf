"""Colocated memory on CUDA: offloaded optimizer state frees device memory and the steps stay
exact; an engine's released KV cache, graphs and weights come back usable; a `verst train`
with the engine asleep, the optimizer offloaded and checkpointed layers runs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.gpu.test_token_logprobs_cuda import VOCAB, _items
from verst.cli import main
from verst.engine import GenerateRequest, SamplingParams, Scheduler
from verst.models import TinyModelConfig, build_tiny_model
from verst.train.algorithms import LossConfig
from verst.train.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")
SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _trainer(offload: str) -> Trainer:
    model = build_tiny_model(TinyModelConfig(**SHAPE), vocab_size=VOCAB, seed=0)
    cfg = TrainerConfig(lr=1e-3, device="cuda", offload=offload)
    return Trainer(model, cfg, LossConfig(), total_steps=4, pad_token_id=0, device=CUDA)


def test_offloaded_optimizer_steps_equal_plain_ones() -> None:
    plain, offloaded = _trainer("none"), _trainer("optimizer")
    for step in range(3):
        plain.step(_items(), step=step)
        metrics = offloaded.step(_items(), step=step)
        torch.cuda.synchronize()
    state = [v for s in plain.optimizer.state.values() for v in s.values()]
    on_device = sum(v.numel() * v.element_size() for v in state if v.is_cuda)
    params = sum(p.numel() for p in offloaded.model.parameters())
    assert metrics["perf/offloaded_bytes"] == on_device >= 2 * 4 * params  # + fused's steps
    expected = plain.full_state_dict()
    for name, value in offloaded.full_state_dict().items():
        assert torch.equal(value, expected[name]), name
    saved = offloaded.optimizer_state()  # back on the device for the save, then off again
    assert offloaded.offload.on_host and len(saved["optimizer"]["state"]) > 0


def test_released_engine_memory_comes_back_usable_on_cuda() -> None:
    model = build_tiny_model(TinyModelConfig(**SHAPE), vocab_size=VOCAB, seed=0)
    model = model.to(CUDA, torch.bfloat16)
    weights = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    engine = Scheduler.for_model(model, eos_token_ids=[1], pad_token_id=0, kv_cache_bytes=64 << 20)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [GenerateRequest(input_ids=[5 + i, 9, 11], sampling_params=params) for i in range(3)]
    before = [out.output_ids for out in engine.generate(copy.deepcopy(requests))]
    allocated = torch.cuda.memory_allocated()
    freed = engine.memory.release()
    assert freed >= 64 << 19 and torch.cuda.memory_allocated() <= allocated - freed
    engine.memory.resume()
    engine.update_weights_from_tensors(weights, version=1)
    assert [out.output_ids for out in engine.generate(copy.deepcopy(requests))] == before


def test_a_colocated_run_with_every_memory_lever(tmp_path: Path) -> None:
    args = [
        "train",
        "num_steps=2",
        "trainer.device=cuda",
        "warm_start.enabled=false",
        "eval.interval_steps=0",
        "checkpoint.interval_steps=0",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "placement.sleep_engines=true",
        "trainer.offload=optimizer",
        "trainer.gradient_checkpointing=true",
        "loss.entropy_coef=0.01",  # a gradient (and AdamW state) with no reward yet
        "--run-dir",
        str(tmp_path / "run"),
    ]
    assert main(args) == 0
    rows = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
        if line
    ]
    last = rows[-1]
    assert last["step"] == 2 and last["perf/engine_released_bytes"] > 0
    assert last["perf/offloaded_bytes"] > 0 and last["perf/train_peak_memory_gb"] > 0
