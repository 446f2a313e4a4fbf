"""A fleet for a trainer of several ranks (torchrun): the engines belong to rank 0, and every
rank's `generate` goes through them; `on_rank_zero` and `scatter_from_rank_zero` do the same for
agents and for the groups the fully asynchronous buffer serves.

`RankedFleet.generate(requests)` is a collective: each rank passes its own share (the rollout,
the evaluator and the warm start already slice their prompts by rank), rank 0 gathers them,
runs them all on its `Fleet` at once (so a group's samples still meet on one engine), and each
rank gets its own outputs back, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from verst import distributed
from verst.engine import GenerateOutput, GenerateRequest
from verst.fleet.fleet import Fleet

T = TypeVar("T")


def on_rank_zero(mine: list[Any], fn: Callable[[list[Any]], list[T]] | None) -> list[T]:
    """A collective: every rank's list is gathered to rank 0, `fn` (rank 0's; None elsewhere)
    maps all of them at once, in rank order, one result per item, and each rank gets the results
    of its own items back, in order."""
    world = distributed.world_size()
    lists: list[list[Any]] | None = [[] for _ in range(world)] if fn is not None else None
    dist.gather_object(mine, lists, dst=0)
    answers: list[list[T]] | None = None
    if fn is not None:
        assert lists is not None
        results = fn([item for share in lists for item in share])
        answers, start = [], 0
        for share in lists:
            answers.append(results[start : start + len(share)])
            start += len(share)
    return scatter_from_rank_zero(answers)


def scatter_from_rank_zero(per_rank: list[list[T]] | None) -> list[T]:
    """A collective: rank 0 passes one list per rank (the others None); each rank gets its own."""
    mine: list[list[T] | None] = [None]
    dist.scatter_object_list(mine, per_rank, src=0)
    assert mine[0] is not None
    return mine[0]


class RankedFleet:
    def __init__(self, fleet: Fleet | None) -> None:
        if (fleet is None) != (distributed.rank() != 0):
            raise ValueError("rank 0, and only rank 0, holds the fleet")
        self.fleet = fleet
        self.weight_version = 0  # every rank tracks it; rank 0's fleet holds the same

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        return on_rank_zero(requests, self.fleet.generate if self.fleet is not None else None)
