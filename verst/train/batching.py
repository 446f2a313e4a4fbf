"""Training batches: `TrainItem` (one sample as the trainer sees it) and `MicroBatch` tensors.

A micro-batch holds each distinct prompt once (left-padded) and the responses that continue
it (right-padded), so a group's shared prompt is run once per micro-batch, not per sample.
Micro-batches are sized by a padded-token budget, each a run of similar lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from verst.models.forward import cached_forward, new_cache
from verst.types import Sample


@dataclass
class TrainItem:
    """What the trainer needs of one Sample: its tokens, its reward, and its sequence-level
    advantage (group-relative for the group estimators; token-level estimators such as PPO
    build theirs from `reward` inside the trainer)."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    advantage: float
    reward: float = 0.0
    teacher_logprobs: list[float] | None = None  # loss.opd: the teacher's, per response token
    adapter: str | None = None  # multi-LoRA: the adapter it trains
    routed_experts: torch.Tensor | None = None  # MoE: the rollout's experts (Sample's)

    @classmethod
    def from_sample(cls, sample: Sample, advantage: float) -> TrainItem:
        return cls(
            sample.tokens,
            sample.response_length,
            sample.loss_mask,
            sample.rollout_logprobs,
            advantage,
            sample.reward or 0.0,
            sample.teacher_logprobs,
            sample.adapter,
            sample.routed_experts,
        )


@dataclass
class MicroBatch:
    """K distinct prompts (left-padded) and B responses (right-padded) that continue them.

    Samples of one group share their prompt, so the prompt is run once and its KV cache is
    shared by all B responses: the forward and backward cost of the prompt is paid per group,
    not per sample. Per-token fields are [B, T], aligned with `response_ids_B_T`; T >= 2
    (`collate` pads), so every micro-batch takes the same two forwards.
    """

    prompt_ids_K_L: torch.Tensor
    prompt_mask_K_L: torch.Tensor
    prompt_index_B: torch.Tensor  # which prompt each response continues
    response_ids_B_T: torch.Tensor
    response_mask_B_T: torch.Tensor
    loss_mask_B_T: torch.Tensor
    rollout_logprobs_B_T: torch.Tensor
    advantages_B_T: torch.Tensor
    rewards_B: torch.Tensor
    # filled by the trainer's advantage pass for PPO: the critic's values before the update,
    # and the GAE returns they are trained towards
    old_values_B_T: torch.Tensor | None = None
    returns_B_T: torch.Tensor | None = None
    # loss.opd: the teacher's log-prob of each response token; None when no item has them
    teacher_logprobs_B_T: torch.Tensor | None = None
    # MoE: the rollout's experts of each forward call's tokens (`routing_replay.routed_calls`)
    routed_calls: list[torch.Tensor] | None = None


def pack_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices grouped so that (longest length × count) ≤ budget, longest sequences first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for index in order:
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= token_budget:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def micro_batch_indices(lengths: list[int], token_budget: int, count: int) -> list[list[int]]:
    """`count` groups of indices, one per micro-batch: runs of the lengths sorted longest first
    (`pack_micro_batches`), so each pads its rows little past their own lengths. With fewer
    runs than `count` (another rank's items need more), the run of most padded tokens is split
    in two until there are `count`; groups stay empty when there are fewer items than that."""
    batches = pack_micro_batches(lengths, token_budget)
    while len(batches) < count:
        if not batches or all(len(batch) < 2 for batch in batches):
            batches.append([])
            continue
        largest = max(batches, key=lambda batch: lengths[batch[0]] * len(batch))
        at, half = batches.index(largest), len(largest) // 2
        batches[at : at + 1] = [largest[:half], largest[half:]]
    return batches


def masked_out(item: TrainItem) -> TrainItem:
    return TrainItem(
        item.tokens,
        item.response_length,
        [0] * item.response_length,
        item.rollout_logprobs,
        0.0,
        routed_experts=item.routed_experts,
    )


def _pad_right(rows: list[list], width: int, value: float) -> list[list]:
    return [row + [value] * (width - len(row)) for row in rows]


def collate(items: list[TrainItem], pad_token_id: int, device: torch.device) -> MicroBatch:
    prompts: dict[tuple[int, ...], int] = {}
    prompt_index = []
    for item in items:
        prompt = tuple(item.tokens[: len(item.tokens) - item.response_length])
        prompt_index.append(prompts.setdefault(prompt, len(prompts)))
    width_l = max(len(p) for p in prompts)
    # at least 2: a batch of one-token responses would take `response_outputs`'s prompt-only
    # path, one forward fewer than the others, and under FSDP another rank's micro-batch then
    # waits on collectives this rank never joins (the padded column is masked out)
    width_t = max(2, max(item.response_length for item in items))
    responses = [item.tokens[len(item.tokens) - item.response_length :] for item in items]
    advantages_B = torch.tensor([item.advantage for item in items], dtype=torch.float32)
    tensors = (
        torch.tensor([[pad_token_id] * (width_l - len(p)) + list(p) for p in prompts]),
        torch.tensor([[0] * (width_l - len(p)) + [1] * len(p) for p in prompts]),
        torch.tensor(prompt_index),
        torch.tensor(_pad_right(responses, width_t, pad_token_id)),
        torch.tensor(_pad_right([[1] * len(r) for r in responses], width_t, 0)),
        torch.tensor(
            _pad_right([item.loss_mask for item in items], width_t, 0), dtype=torch.float32
        ),
        torch.tensor(
            _pad_right([item.rollout_logprobs for item in items], width_t, 0.0), dtype=torch.float32
        ),
        advantages_B[:, None].expand(-1, width_t).clone(),  # padding is masked out of sums
        torch.tensor([item.reward for item in items], dtype=torch.float32),
    )
    micro = MicroBatch(*(t.to(device) for t in tensors))
    if any(item.teacher_logprobs is not None for item in items):
        # an item the teacher did not score (a masked-out stand-in) gets a penalty of 0
        rows = [item.teacher_logprobs or item.rollout_logprobs for item in items]
        teacher = torch.tensor(_pad_right(rows, width_t, 0.0), dtype=torch.float32)
        micro.teacher_logprobs_B_T = teacher.to(device)
    return micro


def response_outputs(model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor:
    """Model outputs [B, T, X] where position j is the prediction for response token j.

    Each distinct prompt runs once; its KV cache rows are repeated for the responses that
    continue it. The last response token predicts nothing we train on and nothing attends to
    it, so only tokens 0..T-2 are fed.
    """
    first_B_1_X, cache = prompt_outputs(model, micro)
    return torch.cat([first_B_1_X, continuation_outputs(model, micro, cache)], dim=1)


def prompt_outputs(
    model: torch.nn.Module, micro: MicroBatch
) -> tuple[torch.Tensor, transformers.DynamicCache]:
    """The prediction [B, 1, X] for each response's first token (from its prompt's last
    position), and the prompts' KV cache with rows repeated per response."""
    cache = new_cache(model)
    prompt_positions_K_L = (micro.prompt_mask_K_L.cumsum(-1) - 1).clamp(min=0)
    last_K_1_X = cached_forward(
        model,
        micro.prompt_ids_K_L,
        micro.prompt_mask_K_L,
        prompt_positions_K_L,
        cache,
        last_only=True,
    )
    cache.batch_select_indices(micro.prompt_index_B)
    return last_K_1_X[micro.prompt_index_B], cache


def continuation_outputs(
    model: torch.nn.Module, micro: MicroBatch, cache: transformers.DynamicCache
) -> torch.Tensor:
    """The predictions [B, T-1, X] for response tokens 1..T-1, fed tokens 0..T-2 on top of
    `cache` (from `prompt_outputs`)."""
    index_B = micro.prompt_index_B
    width_t = micro.response_ids_B_T.shape[1]
    prompt_lengths_B_1 = micro.prompt_mask_K_L.sum(-1, keepdim=True)[index_B]
    positions_B_T = prompt_lengths_B_1 + torch.arange(width_t - 1, device=index_B.device)
    mask_B_S = torch.cat([micro.prompt_mask_K_L[index_B], micro.response_mask_B_T[:, :-1]], 1)
    return cached_forward(model, micro.response_ids_B_T[:, :-1], mask_B_S, positions_B_T, cache)
