"""The collectives of the Megatron backend: which items a rank trains on, the global counts
behind the loss normalisers, gradient reduction and norm across TP / PP / EP / DP, metrics
from the ranks that compute the loss, and full HF tensors gathered from TP, EP and PP shards
one entry at a time (non-expert entries first, then experts), never the whole model at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from verst import distributed
from verst.train.batching import TrainItem
from verst.train.megatron.mapping import Entry, WeightMap


def _ps() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def data_parallel_size() -> int:
    return _ps().get_data_parallel_world_size()


def data_parallel_group() -> Any:
    """The ranks that hold the same shards and train on distinct items."""
    return _ps().get_data_parallel_group()


def data_parallel_share(items: list[TrainItem]) -> list[TrainItem]:
    """The world's items (each rank's in rank order), every dp-th from this DP rank's index:
    the ranks of one model-parallel group get the same ones."""
    world = [item for share in distributed.all_gather_object(items) for item in share]
    return world[_ps().get_data_parallel_rank() :: data_parallel_size()]


def normalisers(tokens_per_rank: list[float], sequences_per_rank: list[float]) -> tuple:
    """(token, sequence) normalisers of each DP rank: the global counts ÷ the DP size, so that
    gradients summed over the ranks and divided by their number equal one big batch's."""
    ranks = len(tokens_per_rank)
    return max(sum(tokens_per_rank), 1.0) / ranks, max(sum(sequences_per_rank), 1.0) / ranks


def global_counts(items: list[TrainItem], device: torch.device) -> tuple[float, float]:
    counts = torch.tensor(
        [float(sum(sum(i.loss_mask) for i in items)), float(len(items))],
        dtype=torch.float64,
        device=device,
    )
    gathered = [torch.zeros_like(counts) for _ in range(data_parallel_size())]
    dist.all_gather(gathered, counts, group=data_parallel_group())
    tokens, sequences = zip(*(g.tolist() for g in gathered), strict=True)
    return normalisers(list(tokens), list(sequences))


def _is_loss_rank() -> bool:
    ps = _ps()
    return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0


def loss_rank_sums(sums: dict[str, float]) -> dict[str, float]:
    """The metric sums of the loss ranks (last stage, TP rank 0), summed over DP, on all."""
    shares = distributed.all_gather_object(sums if _is_loss_rank() else None)
    total: dict[str, float] = {}
    for share in shares:
        for key, value in (share or {}).items():
            total[key] = total.get(key, 0.0) + value
    return total


def from_loss_rank(value: Any) -> Any:
    """A loss rank's `value` on every rank (the first loss rank's)."""
    shares = distributed.all_gather_object(value if _is_loss_rank() else None)
    return next(share for share in shares if share is not None)


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def reduce_gradients(model: torch.nn.Module) -> None:
    """Sum each gradient over the ranks holding the same parameter for other data (dense: the
    DP group; experts: the expert-DP group, their EP peers' tokens already in them), ÷ DP size;
    a tied embedding's two copies (first and last stage) are summed first."""
    ps = _ps()
    dp = data_parallel_size()
    if (
        ps.get_pipeline_model_parallel_world_size() > 1
        and model.share_embeddings_and_output_weights
    ):
        if ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage():
            shared = model.shared_embedding_or_output_weight()
            if shared.grad is not None:
                dist.all_reduce(shared.grad, group=ps.get_embedding_group())
    for name, param in model.named_parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        group = (
            ps.get_expert_data_parallel_group()
            if _is_expert(name)
            else ps.get_data_parallel_group()
        )
        if dist.get_world_size(group) > 1:
            dist.all_reduce(param.grad, group=group)
        if dp > 1:
            param.grad.div_(dp)


def gradient_norm(model: torch.nn.Module) -> float:
    """The global L2 norm: each distinct shard counted once (TP copies of replicated tensors
    and the last stage's copy of a tied embedding are not)."""
    ps = _ps()
    tp_rank = ps.get_tensor_model_parallel_rank()
    tied_copy = (
        ps.get_pipeline_model_parallel_world_size() > 1
        and model.share_embeddings_and_output_weights
        and ps.is_pipeline_last_stage()
        and not ps.is_pipeline_first_stage()
    )
    squares = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for name, param in model.named_parameters():
        sharded = getattr(param, "tensor_model_parallel", False) and not _is_expert(name)
        if (not sharded and tp_rank != 0) or (tied_copy and name == "output_layer.weight"):
            continue
        squares[int(_is_expert(name))] += param.grad.double().pow(2).sum()
    dist.all_reduce(squares, group=ps.get_model_parallel_group())
    if ps.get_expert_model_parallel_world_size() > 1:
        experts = squares[1:].clone()
        dist.all_reduce(experts, group=ps.get_expert_model_parallel_group())
        squares[1] = experts[0]
    return float(squares.sum().sqrt())


def hf_tensors(
    model: torch.nn.Module, mapping: WeightMap, *, to_all: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor, whole, entry by entry: gathered over TP (and EP for experts) on the
    stage that holds it, then sent to rank 0 (`to_all`: broadcast to every rank). Other ranks
    yield the same names; without `to_all` their tensors are placeholders."""
    params = dict(model.named_parameters())
    device = next(model.parameters()).device
    sources = _stage_sources() if _ps().get_pipeline_model_parallel_world_size() > 1 else None
    for entry in mapping.entries():
        for name, tensor in _entry_tensors(entry, params, mapping).items():
            if sources is not None:
                tensor = _from_stage(tensor, sources[entry.stage], to_all, device)
            yield name, tensor


def _entry_tensors(entry: Entry, params: dict, mapping: WeightMap) -> dict[str, torch.Tensor]:
    """On the entry's stage: its HF tensors (TP / EP gathered); elsewhere: empty ones."""
    ps = _ps()
    if entry.stage != ps.get_pipeline_model_parallel_rank():
        return {name: torch.empty(0) for name in entry.hf_names}
    if entry.is_expert:
        count = len(mapping.local_experts(0))
        stack = torch.stack([params[entry.name.format(j)].detach() for j in range(count)])
        group = ps.get_expert_model_parallel_group()
        pieces = [torch.empty_like(stack) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, stack.contiguous(), group=group)
        return mapping.merge_experts(entry, [list(p) for p in pieces])
    shard = params[entry.name].detach()
    tp = ps.get_tensor_model_parallel_world_size()
    if entry.kind == "replicated" or tp == 1:
        shards = [shard] * tp
    else:
        shards = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(shards, shard.contiguous(), group=ps.get_tensor_model_parallel_group())
    return mapping.merge(entry, shards)


def _from_stage(tensor: torch.Tensor, source: int, to_all: bool, device: torch.device):
    """`tensor` of rank `source` on rank 0 (`to_all`: on every rank); every rank joins."""
    rank = distributed.rank()
    meta = distributed.all_gather_object((tensor.shape, tensor.dtype) if rank == source else None)
    shape, dtype = meta[source]
    if rank == source:
        buffer = tensor.contiguous()
    elif to_all or rank == 0:
        buffer = torch.empty(shape, dtype=dtype, device=device)
    else:
        return tensor
    if to_all:
        dist.broadcast(buffer, src=source)
    elif source != 0:
        if rank == source:
            dist.send(buffer, dst=0)
        else:
            dist.recv(buffer, src=source)
    return buffer


def _stage_sources() -> list[int]:
    """The global rank of (TP 0, DP 0) on each pipeline stage."""
    ps = _ps()
    coords = distributed.all_gather_object(
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
         ps.get_data_parallel_rank())
    )  # fmt: skip
    stages = ps.get_pipeline_model_parallel_world_size()
    return [coords.index((stage, 0, 0)) for stage in range(stages)]
