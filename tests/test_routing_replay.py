"""Rollout routing replay (R3): a toy MoE whose router flips under tiny noise; with replay the
trainer's MoE layers use exactly the recorded experts and the router still gets gradients;
gate weights at replayed ids against their closed forms; the agreement metric and the log-prob
diff with and without replay; bad records and dense models refused naming the cause."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import PreTrainedModel

from verst.engine import GenerateRequest, SamplingParams, Scheduler
from verst.models import TinyModelConfig, build_char_tokenizer, build_tiny_model
from verst.models.moe import gate_weights, routers, routing_shape
from verst.train.algorithms import LossConfig
from verst.train.batching import TrainItem, collate, response_outputs
from verst.train.routing_replay import RoutingReplay, routed_calls
from verst.train.trainer import Trainer, TrainerConfig

VOCAB = len(build_char_tokenizer())
CPU = torch.device("cpu")
SHAPE = dict(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=32,
    max_position_embeddings=64, num_experts=4, experts_per_token=2,
)  # fmt: skip


def flippy(family: str = "qwen3-moe", noise: float = 0.0, seed: int = 0) -> PreTrainedModel:
    """A tiny MoE whose routers score every expert almost alike: noise of `noise` on the
    router weights flips many of its top-k choices."""
    model = build_tiny_model(TinyModelConfig(family=family, **SHAPE), vocab_size=VOCAB, seed=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, router in routers(model):
            base = torch.randn(router.weight.shape[1], generator=torch.Generator().manual_seed(1))
            tie = base.expand_as(router.weight) * 0.1
            router.weight.copy_(tie + noise * torch.randn(router.weight.shape, generator=gen))
    return model


def rollout(model: PreTrainedModel, prompts: list[list[int]], new: int = 6) -> list[TrainItem]:
    """Samples from the engine with their routed experts and log-probs."""
    engine = Scheduler.for_model(
        copy.deepcopy(model), eos_token_ids=[], pad_token_id=0, kv_cache_bytes=1 << 20, page_size=4
    )
    params = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)
    requests = [GenerateRequest(p, params, return_routed_experts=True) for p in prompts]
    outs = engine.generate(requests)
    return [
        TrainItem(
            tokens=p + out.output_ids,
            response_length=len(out.output_ids),
            loss_mask=[1] * len(out.output_ids),
            rollout_logprobs=out.output_token_logprobs,
            advantage=1.0 if i % 2 else -1.0,
            routed_experts=out.routed_experts,
        )
        for i, (p, out) in enumerate(zip(prompts, outs, strict=True))
    ]


PROMPTS = [[5, 9, 14, 3, 7], [5, 9, 14, 3, 7], [40, 2, 11]]


def experts_used(model: PreTrainedModel) -> tuple[list, list]:
    """Forward pre-hooks on every experts module: the ids each forward call dispatched."""
    seen: list[torch.Tensor] = []
    handles = []
    for layer in model.get_decoder().layers:
        hook = lambda module, args: seen.append(args[1].clone())  # noqa: E731
        handles.append(layer.mlp.experts.register_forward_pre_hook(hook))
    return seen, handles


def test_replay_uses_the_recorded_experts_and_the_router_learns() -> None:
    rollout_model = flippy(noise=1e-3, seed=1)
    items = rollout(rollout_model, PROMPTS)
    trainer_model = flippy(noise=1e-3, seed=2)  # the same weights but its routers' noise
    trainer_model.load_state_dict(
        {k: v for k, v in rollout_model.state_dict().items() if "mlp.gate." not in k}, strict=False
    )
    micro = collate(items, 0, CPU)
    calls = routed_calls(items, micro, routing_shape(trainer_model))
    replay = RoutingReplay(trainer_model, replay=True)
    seen, handles = experts_used(trainer_model)
    with replay.feeding(calls):
        out = response_outputs(trainer_model, micro)
    layers = len(trainer_model.get_decoder().layers)
    assert len(seen) == 2 * layers  # prompt call, response call
    for index, ids in enumerate(seen):
        call, layer = divmod(index, layers)
        recorded = calls[call][:, layer]
        valid = (recorded >= 0).all(-1)
        assert torch.equal(ids[valid], recorded[valid])
    counts = replay.take_counts()
    assert counts["routing_recorded"] > 0
    assert counts["routing_agreed"] < counts["routing_recorded"]  # the noise flipped some
    out.float().logsumexp(-1).sum().backward()
    for _, router in routers(trainer_model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    for handle in handles:
        handle.remove()


def test_gate_weights_closed_forms() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]])
    ids = torch.tensor([[0, 2], [3, 1]])
    qwen = routers(flippy("qwen3-moe"))[0][1]
    e = logits.exp()
    expected = torch.stack([e[r, ids[r]] / e[r, ids[r]].sum() for r in range(2)])
    torch.testing.assert_close(gate_weights(qwen, logits, ids), expected)
    # without normalisation: the softmax over all experts at the ids
    qwen.norm_topk_prob = False
    expected = torch.stack([e[r, ids[r]] / e[r].sum() for r in range(2)])
    torch.testing.assert_close(gate_weights(qwen, logits, ids), expected)
    deepseek = routers(flippy("deepseek-v3"))[0][1]
    s = torch.sigmoid(logits)
    picked = torch.stack([s[r, ids[r]] for r in range(2)])
    expected = picked / picked.sum(-1, keepdim=True) * deepseek.routed_scaling_factor
    torch.testing.assert_close(gate_weights(deepseek, logits, ids), expected)
    gpt = routers(flippy("gpt-oss"))[0][1]
    top = torch.stack([logits[r, ids[r]] for r in range(2)])
    torch.testing.assert_close(gate_weights(gpt, logits, ids), top.softmax(-1))
    assert math.isclose(float(gate_weights(gpt, logits, ids)[0].sum()), 1.0, rel_tol=1e-6)


def make_trainer(model: PreTrainedModel, replay: bool) -> Trainer:
    return Trainer(
        model,
        TrainerConfig(lr=1e-3, device="cpu"),
        LossConfig(routing_replay=replay),
        total_steps=4,
        pad_token_id=0,
        device=CPU,
    )


def test_trainer_step_reports_agreement_and_both_diffs() -> None:
    rollout_model = flippy(noise=1e-3, seed=1)
    items = rollout(rollout_model, PROMPTS)
    for replay in (True, False):
        model = copy.deepcopy(rollout_model)
        with torch.no_grad():  # the trainer's routers differ by tiny noise: some choices flip
            for _, router in routers(model):
                router.weight.add_(1e-3 * torch.randn_like(router.weight))
        metrics = make_trainer(model, replay).step(items, step=0)
        assert 0 < metrics["train/routing_agreement"] < 1
        if replay:
            diff, unreplayed = (
                metrics["train/train_rollout_logprob_abs_diff"],
                metrics["train/train_rollout_logprob_abs_diff_no_replay"],
            )
            assert diff < unreplayed
            assert diff < 1e-3  # only the gate weights' tiny noise is left
        else:
            assert "train/train_rollout_logprob_abs_diff_no_replay" not in metrics


def test_bad_routing_records_and_dense_models_are_refused() -> None:
    model = flippy(noise=1e-3)
    items = rollout(model, PROMPTS[:1])
    bad = copy.copy(items[0])
    bad.routed_experts = items[0].routed_experts[:-1]
    with pytest.raises(ValueError, match=r"routed_experts has shape \(9, 2, 2\), expected \(10, 2"):
        make_trainer(copy.deepcopy(model), True).step([bad], step=0)
    missing = copy.copy(items[0])
    missing.routed_experts = None
    with pytest.raises(ValueError, match="a sample carries no routed_experts"):
        make_trainer(copy.deepcopy(model), True).step([missing], step=0)
    dense = build_tiny_model(TinyModelConfig(**{**SHAPE}), vocab_size=VOCAB, seed=0)
    with pytest.raises(ValueError, match="loss.routing_replay .* Qwen3ForCausalLM has no MoE"):
        make_trainer(dense, True)
