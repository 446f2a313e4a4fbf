"""Log-probabilities and entropy of the sampled tokens, computed from the LM head's input in
chunks of tokens, so the trainer never holds full-vocabulary logits for a micro-batch.

A micro-batch of N tokens over a vocabulary of V has N × V logits: for 32k tokens and
Qwen's 152k vocabulary that is 20 GB in fp32, kept for the backward, where the model that
made them is 1 GB. Here the head's matmul runs on `chunk_tokens` rows at a time, the fp32
log-softmax of each chunk is reduced to two numbers per token (the sampled token's
log-prob and the entropy) and dropped, and the backward recomputes each chunk's logits to
form its gradient. Peak memory for the head is O(chunk × V); the price is one more head
matmul per chunk in the backward.

The head is the model's own `lm_head` module, called from inside the model's forward (its
`forward` answers from a thread-local request while `scoring_tokens` is active), so FSDP2
gathers its weight there exactly as for the plain head. Heads this cannot stand in for (a
bias, a final logit soft-cap, an adapter on the head) keep the full-logits path.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from verst.train.batching import MicroBatch, continuation_outputs, prompt_outputs, response_outputs
from verst.train.losses import entropy_from_logits, logprobs_from_logits

_request = threading.local()


@dataclass
class _Request:
    targets_B_T: Tensor
    temperature: float
    chunk_tokens: int


class _ChunkedTokenScores(torch.autograd.Function):
    """(log p(target), entropy) per row of `hidden_N_H` under softmax(hidden · Wᵀ / T)."""

    @staticmethod
    def forward(ctx, hidden_N_H, weight_V_H, targets_N, temperature, chunk_tokens):
        logprobs_N = hidden_N_H.new_empty(hidden_N_H.shape[0], dtype=torch.float32)
        entropy_N = torch.empty_like(logprobs_N)
        lse_N = torch.empty_like(logprobs_N)
        for rows in _chunks(hidden_N_H.shape[0], chunk_tokens):
            z_C_V = _scaled_logits(hidden_N_H[rows], weight_V_H, temperature)
            lse_C = torch.logsumexp(z_C_V, dim=-1)
            picked_C = z_C_V.gather(-1, targets_N[rows, None]).squeeze(-1)
            p_z_C = (torch.exp(z_C_V - lse_C[:, None]) * z_C_V).sum(-1)  # entropy = lse − Σ p·z
            logprobs_N[rows], entropy_N[rows], lse_N[rows] = picked_C - lse_C, lse_C - p_z_C, lse_C
        ctx.save_for_backward(hidden_N_H, weight_V_H, targets_N, lse_N, entropy_N)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N):
        hidden_N_H, weight_V_H, targets_N, lse_N, entropy_N = ctx.saved_tensors
        temperature = ctx.temperature
        grad_hidden_N_H = torch.empty_like(hidden_N_H)
        grad_weight_V_H = torch.zeros_like(weight_V_H, dtype=torch.float32)
        zeros_N = torch.zeros_like(lse_N)
        grad_logprobs_N = zeros_N if grad_logprobs_N is None else grad_logprobs_N
        grad_entropy_N = zeros_N if grad_entropy_N is None else grad_entropy_N
        for rows in _chunks(hidden_N_H.shape[0], ctx.chunk_tokens):
            # ∂ log p_y / ∂z_j = 1[j = y] − p_j and ∂H / ∂z_j = −p_j (log p_j + H), so
            # ∂L / ∂z_j = 1[j = y] g_y − p_j (g_y + g_H (log p_j + H)); in place, chunk by chunk
            logp_C_V = _scaled_logits(hidden_N_H[rows], weight_V_H, temperature)
            logp_C_V -= lse_N[rows, None]
            probs_C_V = torch.exp(logp_C_V)
            g_C, g_entropy_C = grad_logprobs_N[rows], grad_entropy_N[rows]
            grad_z_C_V = logp_C_V.add_(entropy_N[rows, None]).mul_(g_entropy_C[:, None])
            grad_z_C_V.add_(g_C[:, None]).mul_(probs_C_V).neg_()
            del probs_C_V
            grad_z_C_V.scatter_add_(-1, targets_N[rows, None], g_C[:, None])
            grad_x_C_V = grad_z_C_V.div_(temperature).to(hidden_N_H.dtype)
            del grad_z_C_V
            grad_hidden_N_H[rows] = grad_x_C_V @ weight_V_H
            grad_weight_V_H += (grad_x_C_V.T @ hidden_N_H[rows]).float()
        return grad_hidden_N_H, grad_weight_V_H.to(weight_V_H.dtype), None, None, None


def _chunks(count: int, size: int) -> Iterator[slice]:
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))


def _scaled_logits(hidden_C_H: Tensor, weight_V_H: Tensor, temperature: float) -> Tensor:
    z_C_V = (hidden_C_H @ weight_V_H.T).float()
    return z_C_V.div_(temperature) if temperature != 1.0 else z_C_V


def token_scores(
    hidden_N_H: Tensor, weight_V_H: Tensor, targets_N: Tensor, temperature: float, chunk_tokens: int
) -> tuple[Tensor, Tensor]:
    """fp32 (log-prob of each target, entropy) [N] under softmax(hidden · Wᵀ / temperature),
    `chunk_tokens` rows of logits at a time, forward and backward."""
    return _ChunkedTokenScores.apply(
        hidden_N_H, weight_V_H, targets_N.long(), temperature, chunk_tokens
    )


def can_score_tokens(model: torch.nn.Module) -> bool:
    """Whether the model's output head is a plain bias-free linear map of the last hidden
    state (what `scoring_tokens` computes); otherwise use the full logits."""
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", config)
    return (
        type(head) is torch.nn.Linear
        and head.bias is None
        and getattr(text_config, "final_logit_softcapping", None) is None
    )


def _scoring_forward(head: torch.nn.Linear, hidden_B_T_H: Tensor) -> Tensor:
    request: _Request | None = getattr(_request, "active", None)
    if request is None:
        return torch.nn.functional.linear(hidden_B_T_H, head.weight)
    width_b, width_t, width_h = hidden_B_T_H.shape
    if request.targets_B_T.shape != (width_b, width_t):
        raise RuntimeError(
            f"scoring head got hidden states {tuple(hidden_B_T_H.shape)} for targets "
            f"{tuple(request.targets_B_T.shape)}"
        )
    logprobs_N, entropy_N = token_scores(
        hidden_B_T_H.reshape(-1, width_h),
        head.weight,
        request.targets_B_T.reshape(-1),
        request.temperature,
        request.chunk_tokens,
    )
    # a new tensor, not a view: FSDP2 warns at every step of a wrapped module's view output
    # (an in-place op on one would drop its pre-backward hook)
    shape = (width_b, width_t)
    return torch.stack([logprobs_N.view(shape), entropy_N.view(shape)], dim=-1)


@contextmanager
def scoring_tokens(
    model: torch.nn.Module, targets_B_T: Tensor, temperature: float, chunk_tokens: int
) -> Iterator[None]:
    """Within this block (on this thread), the model's forward returns [B, T, 2] fp32
    (log-prob of `targets_B_T`, entropy) in place of its logits. The head's `forward` is
    replaced once per module; other threads (an in-process engine sharing the module) keep
    the plain head."""
    head = model.get_output_embeddings()
    if getattr(head.forward, "__func__", None) is not _scoring_forward:
        head.forward = types.MethodType(_scoring_forward, head)
    _request.active = _Request(targets_B_T, temperature, chunk_tokens)
    try:
        yield
    finally:
        _request.active = None


def response_scores(
    model: torch.nn.Module,
    micro: MicroBatch,
    temperature: float,
    chunk_tokens: int,
    *,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """fp32 (log-prob, entropy) [B, T] of each response token under softmax(logits / T).

    With `chunk_tokens` > 0 and a head `can_score_tokens` covers, the continuation's logits
    exist `chunk_tokens` rows at a time; otherwise the micro-batch's full logits are formed,
    and the entropy carries a gradient only with `entropy_grad` (it would keep another
    [B, T, V] for the backward)."""
    targets_B_T = micro.response_ids_B_T
    if chunk_tokens == 0 or not can_score_tokens(model):
        logits_B_T_V = response_outputs(model, micro).float() / temperature
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy_B_T = entropy_from_logits(logits_B_T_V)
        return logprobs_from_logits(logits_B_T_V, targets_B_T), entropy_B_T
    first_B_1_V, cache = prompt_outputs(model, micro)
    first_B_1_V = first_B_1_V.float() / temperature
    with scoring_tokens(model, targets_B_T[:, 1:], temperature, chunk_tokens):
        rest_B_T_2 = continuation_outputs(model, micro, cache)
    logprobs_B_T = torch.cat(
        [logprobs_from_logits(first_B_1_V, targets_B_T[:, :1]), rest_B_T_2[..., 0]], 1
    )
    entropy_B_T = torch.cat([entropy_from_logits(first_B_1_V), rest_B_T_2[..., 1]], 1)
    return logprobs_B_T, entropy_B_T
