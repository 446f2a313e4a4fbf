"""A micro-batch as Megatron's GPTModel reads it: each response after its own prompt as one
right-padded row, with explicit positions and a causal-and-padding mask, and the index of the
logits that predict each response token (the FSDP2 backend's `response_outputs` alignment)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verst.train.batching import MicroBatch


@dataclass
class SequenceInputs:
    ids_B_S: torch.Tensor
    positions_B_S: torch.Tensor
    mask_B_1_S_S: torch.Tensor  # True where attention is masked out (Megatron's convention)
    predicts_B_T: torch.Tensor  # row position whose logits predict response token t


def sequence_inputs(micro: MicroBatch, pad_token_id: int) -> SequenceInputs:
    prompt_lengths_K = micro.prompt_mask_K_L.sum(-1)
    response_lengths_B = micro.response_mask_B_T.sum(-1)
    width_l = micro.prompt_ids_K_L.shape[1]
    rows, lengths = [], []
    for b, k in enumerate(micro.prompt_index_B.tolist()):
        prompt = micro.prompt_ids_K_L[k, width_l - int(prompt_lengths_K[k]) :]
        response = micro.response_ids_B_T[b, : int(response_lengths_B[b])]
        rows.append(torch.cat([prompt, response]))
        lengths.append(len(rows[-1]))
    width_s = max(lengths)
    device = micro.response_ids_B_T.device
    ids_B_S = torch.full((len(rows), width_s), pad_token_id, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        ids_B_S[b, : len(row)] = row
    arange_S = torch.arange(width_s, device=device)
    lengths_B = torch.tensor(lengths, device=device)
    causal_S_S = arange_S[None, :] > arange_S[:, None]
    padding_B_S = arange_S[None, :] >= lengths_B[:, None]
    mask = causal_S_S[None] | padding_B_S[:, None, :]
    prompt_lengths_B = prompt_lengths_K[micro.prompt_index_B]
    width_t = micro.response_ids_B_T.shape[1]
    predicts = prompt_lengths_B[:, None] - 1 + torch.arange(width_t, device=device)[None]
    return SequenceInputs(
        ids_B_S,
        arange_S[None].expand(len(rows), -1).contiguous(),
        mask[:, None],
        predicts.clamp(max=width_s - 1),
    )


def response_logits(logits_B_S_V: torch.Tensor, inputs: SequenceInputs, vocab: int):
    """[B, T, V] fp32 logits, position t predicting response token t (padded vocab cut off)."""
    index = inputs.predicts_B_T[..., None].expand(-1, -1, logits_B_S_V.shape[-1])
    return logits_B_S_V.gather(1, index)[..., :vocab].float()
