"""The CPU engine's packed bf16 linear layers: same results as `F.linear`, and never stale."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tiny_qwen3, tiny_qwen3_pool
from verst.engine import GenerateRequest, SamplingParams
from verst.engine.kernels.packed_linear import PackedLinears, packing_available
from verst.engine.scheduler import Scheduler

pytestmark = pytest.mark.skipif(not packing_available(), reason="needs oneDNN (mkldnn)")


def cpu_scheduler(
    model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, lean: bool = True
) -> Scheduler:
    return Scheduler(
        model, tiny_qwen3_pool(dtype), eos_token_ids=[63], pad_token_id=0, lean_forward=lean
    )


def greedy_outputs(scheduler: Scheduler) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 7 + j * 3) % 60 + 1 for j in range(5 + i)] for i in range(3)]
    outs = scheduler.generate(
        [GenerateRequest(input_ids=p, sampling_params=params) for p in prompts]
    )
    return [o.output_ids for o in outs]


def test_packed_linear_equals_f_linear() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    packs = PackedLinears([layer])
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    expected = F.linear(x, layer.weight, layer.bias)
    with packs.swapped():
        packed = layer(x)
        strided = layer(x.transpose(0, 1))  # a non-contiguous input
    assert "forward" not in vars(layer)  # the module is left as it was
    torch.testing.assert_close(packed.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(
        strided.float(),
        F.linear(x.transpose(0, 1), layer.weight, layer.bias).float(),
        atol=2e-2,
        rtol=2e-2,
    )


def test_the_bf16_cpu_engine_packs_its_linears() -> None:
    model = tiny_qwen3().to(torch.bfloat16)
    hf = cpu_scheduler(model, lean=False)
    assert hf.runner.packed is not None
    # q, k, v, o, gate, up, down per layer, and the LM head
    assert len(hf.runner.packed.modules) == 7 * 2 + 1
    lean = cpu_scheduler(model)
    assert lean.runner.packed is None and lean.runner.lean is not None
    greedy_outputs(lean)
    # q/k/v fused, o, gate/up fused, down per layer, and the LM head: each packed once
    assert len(lean.runner.lean.derived._entries) == 4 * 2 + 1
    fp32 = cpu_scheduler(tiny_qwen3(), torch.float32)
    assert fp32.runner.packed is None and not fp32.runner.lean.derived._entries


def changed(model: torch.nn.Module) -> torch.nn.Module:
    new = copy.deepcopy(model)
    with torch.no_grad():
        for param in new.parameters():
            param.mul_(-1.5)
    return new


@pytest.mark.parametrize("lean", [True, False])
def test_a_weight_update_reaches_the_packed_weights(lean: bool) -> None:
    model = tiny_qwen3().to(torch.bfloat16)
    target = changed(model)
    scheduler = cpu_scheduler(model, lean=lean)
    before = greedy_outputs(scheduler)
    scheduler.update_weights_from_tensors(list(target.named_parameters()), version=1)
    after = greedy_outputs(scheduler)
    assert after == greedy_outputs(cpu_scheduler(target))
    assert after != before


@pytest.mark.parametrize("lean", [True, False])
def test_a_zero_copy_update_reaches_the_packed_weights_at_the_version_bump(lean: bool) -> None:
    # the colocated transport re-points the engine's parameters at the trainer's storage
    # (`.data = ...`); the optimiser then writes that storage and only the version is bumped
    model = tiny_qwen3().to(torch.bfloat16)
    trainer_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        param.data = trainer_weights[name]
    scheduler = cpu_scheduler(model, lean=lean)
    before = greedy_outputs(scheduler)
    target = changed(model)
    with torch.no_grad():
        for name, param in target.named_parameters():
            trainer_weights[name].copy_(param)
    scheduler.flush_cache()  # as the sync protocol does (its cached KV is of the old weights)
    scheduler.set_weight_version(1)
    after = greedy_outputs(scheduler)
    assert after == greedy_outputs(cpu_scheduler(target))
    assert after != before


@pytest.mark.parametrize("lean", [True, False])
def test_a_weight_written_in_place_is_packed_again_even_untold(lean: bool) -> None:
    model = tiny_qwen3().to(torch.bfloat16)
    target = changed(model)
    scheduler = cpu_scheduler(model, lean=lean)
    greedy_outputs(scheduler)
    with torch.no_grad():
        for (_, param), (_, new) in zip(
            model.named_parameters(), target.named_parameters(), strict=True
        ):
            param.copy_(new)  # moves the parameter's version counter
    scheduler.flush_cache()
    assert greedy_outputs(scheduler) == greedy_outputs(cpu_scheduler(target))
