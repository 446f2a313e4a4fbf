"""trainer.gradient_checkpointing: the same step as without it (exact in fp32), with the KV
cache of the shared-prompt forward, on the policy and the PPO critic; refusals name the cause."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.test_trainer import CPU, TINY, items, tiny_model, weights
from verst.config import RunConfig
from verst.models.tiny import build_tiny_model
from verst.train.activation_checkpointing import checkpoint_layers
from verst.train.algorithms import LossConfig
from verst.train.critic import ValueModel
from verst.train.trainer import Trainer, TrainerConfig


def _trainer(model: torch.nn.Module, loss: LossConfig, **overrides) -> Trainer:
    cfg = TrainerConfig(lr=1e-2, device="cpu", micro_batch_tokens=24, **overrides)
    return Trainer(model, cfg, loss, total_steps=10, pad_token_id=0, device=CPU)


def _saved_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors autograd saves for the backward of one policy forward."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    ids = torch.randint(3, 40, (4, 48))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids).logits.sum()
    return sum(saved)


@pytest.mark.parametrize("chunk", [0, 16])
def test_checkpointed_steps_equal_plain_ones(chunk: int) -> None:
    loss = LossConfig(entropy_coef=0.01)
    plain = _trainer(tiny_model(), loss, logprob_chunk_tokens=chunk)
    checkpointed = _trainer(
        tiny_model(), loss, logprob_chunk_tokens=chunk, gradient_checkpointing=True
    )
    for step in range(2):
        a = plain.step(items(step), step=step)
        b = checkpointed.step(items(step), step=step)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-6)
    for name, value in weights(plain).items():
        torch.testing.assert_close(weights(checkpointed)[name], value, rtol=1e-6, atol=1e-7)


def test_the_ppo_critic_is_checkpointed_too() -> None:
    loss = LossConfig(advantage_estimator="ppo")
    trainers = []
    for checkpointing in (False, True):
        trainer = _trainer(tiny_model(), loss, gradient_checkpointing=checkpointing)
        trainer.attach_critic(ValueModel(tiny_model()))  # built from the unsharded shell
        rewarded = [
            dataclasses.replace(item, reward=float(i % 2)) for i, item in enumerate(items())
        ]
        for step in range(2):  # the zero value head learns in the first, the body in the second
            trainer.step(rewarded, step=step)
        trainers.append(trainer)
    plain, checkpointed = (t.critic.model.layers[0].mlp.up_proj.weight for t in trainers)
    assert (
        plain.full_tensor() != ValueModel(tiny_model()).model.layers[0].mlp.up_proj.weight
    ).any()
    torch.testing.assert_close(
        checkpointed.full_tensor(), plain.full_tensor(), rtol=1e-6, atol=1e-7
    )
    layer = trainers[1].critic.model.layers[0]
    assert layer.forward.__self__ is layer  # bound to the critic's copy, not the policy's


def test_checkpointing_keeps_less_for_the_backward() -> None:
    model = build_tiny_model(TINY, vocab_size=40, seed=0)
    plain = _saved_bytes(model)
    checkpoint_layers(model)
    assert _saved_bytes(model) < 0.6 * plain
    copied = copy.deepcopy(model)
    assert copied.model.layers[1].forward.__self__ is copied.model.layers[1]


def test_without_gradients_a_checkpointed_layer_runs_as_is() -> None:
    model = checkpoint_layers_of(tiny_model())
    reference = tiny_model()
    ids = torch.randint(3, 40, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_the_replay_allows_the_attention_backends_the_forward_did() -> None:
    """The backward's replay runs outside the forward's `sdpa_kernel` scope; on CUDA another
    backend there (cuDNN, which the trainer's passes exclude) saves other tensors and
    checkpoint refuses the replay. Each layer call records the backends it may use."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = checkpoint_layers_of(tiny_model())
    seen: list[tuple[bool, bool]] = []
    layer = model.model.layers[0]
    inner = type(layer).forward  # every layer's: the class's

    def recording(self, *args, **kwargs):
        seen.append(
            (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
        )
        return inner(self, *args, **kwargs)

    type(layer).forward = recording
    try:
        with sdpa_kernel([SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION]):
            loss = model(input_ids=torch.randint(3, 40, (2, 10))).logits.sum()
        loss.backward()
    finally:
        type(layer).forward = inner
    assert len(seen) == 2 * TINY.num_layers  # each layer's forward, then its replay
    assert set(seen) == {(False, False)}


def checkpoint_layers_of(model: torch.nn.Module) -> torch.nn.Module:
    assert checkpoint_layers(model) == TINY.num_layers
    return model


@pytest.mark.parametrize(
    ("overrides", "cause"),
    [
        ({"trainer": {"gradient_checkpointing": True, "backend": "megatron"}}, "Megatron"),
        (
            {
                "model": {"tiny": {"family": "qwen3-moe"}},
                "loss": {"routing_replay": True},
                "trainer": {"gradient_checkpointing": True},
            },
            "route its tokens again",
        ),
        (
            {"trainer": {"gradient_checkpointing": True, "true_on_policy": True}},
            "invariant forward keeps its activations",
        ),
    ],
)
def test_combinations_it_cannot_serve_are_refused(overrides: dict, cause: str) -> None:
    with pytest.raises(ValueError, match=cause):
        RunConfig.model_validate(overrides)
