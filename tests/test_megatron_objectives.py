"""The megatron backend's objectives beyond plain GRPO, each against the FSDP2 trainer on the
same batch (fp32, CPU, TP = PP = 1): the supervised step and held-out metrics, the KL loss to
a frozen reference, and the per-token advantage pass (KL reward, whitening, on-policy
distillation). Loss, gradient norm and the updated weights must agree to fp32 round-off."""

from __future__ import annotations

import copy

import pytest
import torch

from verst.models.tiny import TinyModelConfig, build_tiny_model
from verst.train.algorithms import LossConfig
from verst.train.batching import TrainItem
from verst.train.opd import OPDConfig
from verst.train.trainer import Trainer, TrainerConfig

pytest.importorskip("megatron.core")
VOCAB = 40


def _model():
    shape = TinyModelConfig(
        family="qwen3", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=48, tie_word_embeddings=True,
    )  # fmt: skip
    return build_tiny_model(shape, VOCAB, seed=0)


def _items(seed: int, teacher: bool = False) -> list[TrainItem]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    shapes = [(5, 4, 1.0, 1.0), (5, 6, -1.0, 0.0), (3, 2, 0.5, 1.0), (4, 3, 0.0, 0.0)]
    for prompt_len, response_len, advantage, reward in shapes:
        tokens = torch.randint(1, VOCAB, (prompt_len + response_len,), generator=gen).tolist()
        mask = [1] * response_len
        mask[-1] = 0 if response_len > 3 else 1  # a masked token inside the batch
        rollout = (-torch.rand(response_len, generator=gen) - 1.5).tolist()
        teacher_lp = (-torch.rand(response_len, generator=gen) - 1.0).tolist() if teacher else None
        out.append(TrainItem(tokens, response_len, mask, rollout, advantage, reward, teacher_lp))
    return out


def _pair(loss: LossConfig, reference: bool = False, **trainer):
    """A megatron and an FSDP2 trainer from the same weights (and each its reference)."""
    from verst.train.megatron.trainer import MegatronTrainer

    model, cpu = _model(), torch.device("cpu")
    # Adam's first steps move a weight by about lr·g/(|g| + eps): with eps above the round-off
    # of the two backends' gradients (different GEMM shapes: Megatron fuses q/k/v and gate/up),
    # no weight's update flips between ±lr and 0
    settings = dict(dtype="float32", device="cpu", lr=1e-3, adam_eps=1e-5, **trainer)
    common = dict(total_steps=4, pad_token_id=0, device=cpu)
    megatron = MegatronTrainer(
        copy.deepcopy(model), TrainerConfig(backend="megatron", **settings), loss, **common
    )
    fsdp = Trainer(copy.deepcopy(model), TrainerConfig(**settings), loss, **common)
    if reference:
        megatron.set_reference(model)
        fsdp.set_reference(model)
    return megatron, fsdp


def _same_weights(megatron, fsdp, atol: float = 1e-6) -> None:
    ours, theirs = megatron.full_state_dict(), fsdp.full_state_dict()
    assert ours.keys() <= theirs.keys()
    for name, tensor in ours.items():
        diff = float((tensor - theirs[name]).abs().max())
        assert diff <= atol, (name, diff)


def _same_rl_steps(loss: LossConfig, *, teacher: bool = False, reference: bool = True):
    megatron, fsdp = _pair(loss, reference=reference)
    for step in (1, 2):  # step 2: the policy has moved off the reference
        items = _items(step, teacher)
        ours, theirs = megatron.step(items, step=step), fsdp.step(items, step=step)
        for key in ("train/loss", "train/pg_loss", "train/entropy", "train/kl_loss"):
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], abs=2e-6), key
        assert ours["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-4)
        _same_weights(megatron, fsdp)
    return ours, theirs


def test_sft_step_and_eval_match_fsdp2() -> None:
    megatron, fsdp = _pair(LossConfig(), lr_warmup_steps=1, grad_clip=0.5)
    for step in (1, 2):
        items = _items(step)
        ours = megatron.sft_step(items, megatron.optimizer, step=step, scheduler=megatron.scheduler)
        theirs = fsdp.sft_step(items, fsdp.optimizer, step=step, scheduler=fsdp.scheduler)
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert ours["tokens"] == theirs["tokens"] == 13
        _same_weights(megatron, fsdp)
    held_out = _items(3)
    ours, theirs = megatron.sft_eval(held_out), fsdp.sft_eval(held_out)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, abs=1e-6), key
    # the warm start's own optimiser
    optimizers = megatron.make_optimizer(1e-3), fsdp.make_optimizer(1e-3)
    ours = megatron.sft_step(held_out, optimizers[0], step=3)
    theirs = fsdp.sft_step(held_out, optimizers[1], step=3)
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
    _same_weights(megatron, fsdp)


@pytest.mark.parametrize("kind", ["k1", "low_var_kl"])
def test_kl_loss_to_the_reference_matches_fsdp2(kind: str) -> None:
    ours, _ = _same_rl_steps(LossConfig(kl_loss_coef=0.5, kl_loss_type=kind))
    assert ours["train/kl_loss"] != 0.0  # the compared step has a KL term to follow


def test_kl_reward_with_whitening_matches_fsdp2() -> None:
    """REINFORCE++ (KL as a per-token reward, advantages whitened over the batch)."""
    _same_rl_steps(LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.2))


def test_whitened_group_advantages_match_fsdp2() -> None:
    _same_rl_steps(LossConfig(normalize_advantages=True), reference=False)


def test_on_policy_distillation_matches_fsdp2() -> None:
    opd = OPDConfig(coef=0.7, teacher_urls={"default": "http://127.0.0.1:1"})
    _same_rl_steps(LossConfig(opd=opd), teacher=True, reference=False)


def test_reference_stays_frozen_and_restores_from_weights() -> None:
    """`set_reference(shell, weights)` (what --resume does) gives the reference those HF
    weights, whatever the policy holds by then."""
    loss = LossConfig(kl_loss_coef=0.5)
    megatron, _ = _pair(loss, reference=True)
    start = {name: tensor.clone() for name, tensor in megatron.full_state_dict().items()}
    megatron.step(_items(1), step=1)
    items = _items(2)
    frozen = [
        megatron._forward_logprobs(megatron.reference, m) for m in megatron._micro_batches(items)
    ]
    megatron.set_reference(_model(), start)
    again = [
        megatron._forward_logprobs(megatron.reference, m) for m in megatron._micro_batches(items)
    ]
    for a, b in zip(frozen, again, strict=True):
        assert torch.equal(a, b)
    assert not any(p.requires_grad for p in megatron.reference.parameters())


def test_data_parallel_ranks_match_fsdp2_on_the_same_global_batch(tmp_path) -> None:
    """Two ranks over gloo: megatron's data-parallel reductions (normalisers, gradients,
    whitening over the DP group, metrics from the loss ranks) against FSDP2 sharded over the
    same two ranks (`tests/megatron_data_parallel.py`)."""
    import json

    from tests.test_loop import torchrun_module

    out = tmp_path / "result.json"
    torchrun_module("tests.megatron_data_parallel", [str(out)])
    result = json.loads(out.read_text())
    assert result["world"] == 2
    assert result["loss"] < 2e-6 and result["eval"] < 1e-5, result
    assert result["grad_norm"] < 1e-4 and result["weights"] < 1e-6, result
