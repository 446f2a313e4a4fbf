"""The chunked scoring of sampled tokens: log-probs, entropy and both gradients equal the
full-logits computation's, on raw tensors, on every tiny model family, and through a step."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from verst.models import TinyModelConfig, build_char_tokenizer, build_tiny_model
from verst.train.batching import TrainItem, collate, response_outputs
from verst.train.losses import entropy_from_logits, logprobs_from_logits
from verst.train.token_logprobs import (
    can_score_tokens,
    response_scores,
    scoring_tokens,
    token_scores,
)

VOCAB = len(build_char_tokenizer())


def _full(hidden_N_H, weight_V_H, targets_N, temperature):
    logits = (hidden_N_H @ weight_V_H.T).float()[None] / temperature
    return logprobs_from_logits(logits, targets_N[None])[0], entropy_from_logits(logits)[0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_token_scores_and_gradients_equal_the_full_logits(temperature: float, chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=gen, requires_grad=True)
    weight = torch.randn(13, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 13, (10,), generator=gen)
    g_logp, g_ent = torch.randn(10, generator=gen), torch.randn(10, generator=gen)

    def grads(scores):
        logp, ent = scores
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        out = hidden.grad.clone(), weight.grad.clone(), logp.detach(), ent.detach()
        hidden.grad = weight.grad = None
        return out

    expected = grads(_full(hidden, weight, targets, temperature))
    got = grads(token_scores(hidden, weight, targets, temperature, chunk))
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


def test_token_scores_closed_forms() -> None:
    # all-zero logits: every token has probability 1/V and the entropy is log V
    logp, ent = token_scores(torch.zeros(3, 4), torch.ones(5, 4), torch.tensor([0, 2, 4]), 1.0, 2)
    torch.testing.assert_close(logp, torch.full((3,), -math.log(5)))
    torch.testing.assert_close(ent, torch.full((3,), math.log(5)))
    # d log p(y) / d logit_j = 1[j = y] − p_j; with one hidden unit h = 1, logit_j = w_j
    weight = torch.tensor([[0.0], [math.log(3.0)]], requires_grad=True)  # p = (1/4, 3/4)
    logp, _ = token_scores(torch.ones(1, 1), weight, torch.tensor([1]), 1.0, 1)
    logp.sum().backward()
    torch.testing.assert_close(weight.grad, torch.tensor([[-0.25], [0.25]]))


def test_only_the_scoring_thread_gets_scores() -> None:
    model = build_tiny_model(TinyModelConfig(), vocab_size=VOCAB, seed=0)
    ids = torch.tensor([[3, 4, 5]])
    seen = {}

    def other_thread() -> None:
        seen["logits"] = model(input_ids=ids).logits

    with scoring_tokens(model, torch.tensor([[4, 5, 6]]), 1.0, 2):
        scored = model(input_ids=ids).logits
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert scored.shape == (1, 3, 2) and seen["logits"].shape == (1, 3, VOCAB)
    assert model(input_ids=ids).logits.shape == (1, 3, VOCAB)  # and back to logits after


def _micro():
    items = [
        TrainItem([5, 6, 7, 8, 9, 10, 11], 4, [1, 1, 1, 1], [0.0] * 4, 1.0),
        TrainItem([5, 6, 7, 12, 13], 2, [1, 1], [0.0] * 2, -1.0),
        TrainItem([20, 21, 22], 1, [1], [0.0], 0.5),
    ]
    return collate(items, pad_token_id=0, device=torch.device("cpu"))


# a dense model, one whose soft-capped head keeps the full logits, an MoE and an MLA one
@pytest.mark.parametrize("family", ["qwen2", "gemma3", "qwen3-moe", "deepseek-v3"])
def test_response_scores_equal_the_full_forward(family: str) -> None:
    shape = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=32)
    model = build_tiny_model(TinyModelConfig(family=family, **shape), vocab_size=VOCAB, seed=0)
    micro = _micro()
    logits = response_outputs(model, micro).float() / 0.8
    want_logp = logprobs_from_logits(logits, micro.response_ids_B_T)
    want_ent = entropy_from_logits(logits)
    (want_logp.sum() + want_ent.sum()).backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp, ent = response_scores(model, micro, 0.8, chunk_tokens=3, entropy_grad=True)
    (logp.sum() + ent.sum()).backward()
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    for want, param in zip(want_grads, model.parameters(), strict=True):
        torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=1e-5)
    assert can_score_tokens(model) == (family != "gemma3")  # its logits are soft-capped
