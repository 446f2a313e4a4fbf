"""Colocated memory: optimizer state offloaded between steps comes back exact, an engine's
released memory comes back usable, and a `verst train` with the engine asleep while the trainer
trains is the same run as one without (CUDA runs are in tests/gpu/test_colocated_cuda.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_qwen3
from tests.test_loop import SMALL, records
from tests.test_scheduler import greedy, prompt, scheduler
from verst.cli import main
from verst.config import RunConfig
from verst.engine import GenerateRequest
from verst.train.algorithms import LossConfig
from verst.train.offload import OptimizerOffload
from verst.train.trainer import Trainer, TrainerConfig

CPU = torch.device("cpu")


def _adam_steps(offloaded: bool, steps: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    offload = OptimizerOffload(lambda: [optimizer], CPU)
    for step in range(steps):
        offload.to_device()
        model(torch.full((4, 8), float(step))).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if offloaded:
            moved = offload.to_host()
            moments = 2 * 4 * sum(p.numel() for p in model.parameters())
            assert moved == moments + 4 * 4  # and, on this device, each tensor's step count
            state = optimizer.state[next(model.parameters())]
            assert state["exp_avg"].untyped_storage().nbytes() == 0  # its memory is gone
    return model


def test_offloaded_adam_steps_equal_plain_ones() -> None:
    plain, offloaded = _adam_steps(False), _adam_steps(True)
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)


def test_offloaded_state_is_on_the_device_for_a_checkpoint() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    offload = OptimizerOffload(lambda: [optimizer], CPU)
    offload.to_host()
    with offload.on_device():
        torch.testing.assert_close(optimizer.state_dict()["state"], saved["state"])
    assert offload.on_host


def test_a_cpu_trainer_refuses_to_offload() -> None:
    cfg = TrainerConfig(device="cpu", offload="optimizer")
    with pytest.raises(ValueError, match="in host memory already"):
        Trainer(tiny_qwen3(), cfg, LossConfig(), total_steps=1, pad_token_id=0, device=CPU)


def test_released_engine_memory_comes_back_usable() -> None:
    model = tiny_qwen3()
    engine = scheduler(model)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    requests = [GenerateRequest(input_ids=prompt(i), sampling_params=greedy()) for i in range(3)]
    before = [out.output_ids for out in engine.generate(copy.deepcopy(requests))]
    pool = [t.untyped_storage().nbytes() for t in engine.pool._k_store + engine.pool._v_store]
    params = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in model.parameters()}
    assert engine.memory.release() == sum(pool) + sum(params.values())
    assert engine.pool.k[0].untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="kv_cache, weights memory is released"):
        engine.submit(copy.deepcopy(requests[0]))
    engine.memory.resume()
    engine.update_weights_from_tensors(list(weights.items()), version=1)
    after = [out.output_ids for out in engine.generate(copy.deepcopy(requests))]
    assert after == before


def test_release_needs_an_idle_engine_and_known_tags() -> None:
    engine = scheduler(tiny_qwen3())
    engine.submit(GenerateRequest(input_ids=prompt(0), sampling_params=greedy()))
    with pytest.raises(RuntimeError, match="needs an idle engine; 1 requests"):
        engine.memory.release(["kv_cache"])
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.memory.release(["activations"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # zero-copy engine; a copy of its own
def test_a_run_with_the_engine_asleep_equals_one_without(tmp_path: Path, dtype: str) -> None:
    common = [*SMALL, "num_steps=2", "checkpoint.interval_steps=0", f"trainer.dtype={dtype}"]
    for name, sleep in (("awake", "false"), ("asleep", "true")):
        run = ["train", *common, f"placement.sleep_engines={sleep}"]
        assert main([*run, "--run-dir", str(tmp_path / name)]) == 0
    awake, asleep = records(tmp_path / "awake"), records(tmp_path / "asleep")
    for a, b in zip(awake[1:], asleep[1:], strict=True):
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss"):
            assert a[key] == b[key], key
        assert b["perf/engine_released_bytes"] > 0 and "perf/engine_released_bytes" not in a


def test_sleep_is_for_the_embedded_engine() -> None:
    with pytest.raises(ValueError, match="keep theirs"):
        RunConfig.model_validate({"placement": {"engines": "in_process", "sleep_engines": True}})
