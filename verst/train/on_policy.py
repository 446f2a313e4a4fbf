"""The trainer's log-probs in true on-policy mode (`trainer.true_on_policy`): each sample's
prompt and response as one sequence through the batch-invariant forward the engine runs
(`verst.models.invariant_forward`), then the sampler's own temperature division and fp32
log-softmax, so each log-prob is bitwise the one the engine sampled with.

The forward runs as the model's `forward` (swapped in for the call on this thread), so FSDP's
hooks gather and cast the parameters and reduce the gradients exactly as for HF's forward.
"""

from __future__ import annotations

import threading
import types

import torch
from torch import Tensor

from verst.models.invariant_forward import InvariantDecoder, own_keys
from verst.train.batching import MicroBatch

_active = threading.local()


def invariant_scores(
    model: torch.nn.Module, micro: MicroBatch, temperature: float, pad_id: int
) -> tuple[Tensor, Tensor]:
    """fp32 (log-prob, entropy) [B, T] of each response token, as the engine computed them."""
    ids_B_L, picks_B_T = _sequences(micro, pad_id)
    _install(model)
    _active.on = True
    try:
        logits_N_V = model(ids_B_L, picks_B_T)
    finally:
        _active.on = False
    B, T = picks_B_T.shape
    # as `sampling.sample_next_tokens` does it: a float32 temperature per row
    temp_N = torch.full((B * T,), temperature, device=logits_N_V.device).float()
    logprobs_N_V = torch.log_softmax(logits_N_V / temp_N.unsqueeze(-1), dim=-1)
    targets_N_1 = micro.response_ids_B_T.reshape(-1, 1).long()
    logprobs_B_T = logprobs_N_V.gather(-1, targets_N_1).view(B, T)
    entropy_B_T = -(logprobs_N_V.exp() * logprobs_N_V).sum(-1).view(B, T)
    return logprobs_B_T, entropy_B_T


def _sequences(micro: MicroBatch, pad_id: int) -> tuple[Tensor, Tensor]:
    """Each response after its prompt, right-padded [B, L]; and the position whose logits
    predict each response token [B, T]."""
    pairs = zip(micro.prompt_ids_K_L, micro.prompt_mask_K_L, strict=True)
    prompts = [ids_L[mask_L.bool()] for ids_L, mask_L in pairs]
    rows = []
    for b, k in enumerate(micro.prompt_index_B.tolist()):
        response = micro.response_ids_B_T[b][micro.response_mask_B_T[b].bool()]
        rows.append(torch.cat([prompts[k], response]))
    width = max(len(row) for row in rows)
    ids_B_L = torch.full((len(rows), width), pad_id, dtype=torch.long, device=rows[0].device)
    for b, row in enumerate(rows):
        ids_B_L[b, : len(row)] = row
    starts_B = torch.tensor([len(prompts[k]) - 1 for k in micro.prompt_index_B.tolist()])
    steps_T = torch.arange(micro.response_ids_B_T.shape[1])
    picks_B_T = (starts_B[:, None] + steps_T).clamp(max=width - 1)
    return ids_B_L, picks_B_T.to(ids_B_L.device)


def _install(model: torch.nn.Module) -> None:
    if getattr(model.forward, "__func__", None) is not _forward:
        model.__dict__["_hf_forward"] = model.forward
        model.forward = types.MethodType(_forward, model)


def _forward(self: torch.nn.Module, *args, **kwargs):
    if not getattr(_active, "on", False):
        return self._hf_forward(*args, **kwargs)
    ids_B_L, picks_B_T = args
    B, L = ids_B_L.shape
    decoder = InvariantDecoder(self)
    positions_B_L = torch.arange(L, device=ids_B_L.device).expand(B, L)
    hidden_B_L_E = decoder.hidden(ids_B_L, positions_B_L, own_keys)
    E = hidden_B_L_E.shape[-1]
    picked_B_T_E = hidden_B_L_E.gather(1, picks_B_T[..., None].expand(-1, -1, E))
    return decoder.logits(picked_B_T_E.reshape(-1, E))  # [B·T, V]: FSDP hooks want no view
