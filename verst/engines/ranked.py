"""A fleet for a trainer of several ranks (torchrun): the engines belong to rank 0, and every
rank's `generate` goes through them.

`RankedFleet.generate(requests)` is a collective: each rank passes its own share (the rollout,
the evaluator and the warm start already slice their prompts by rank), rank 0 gathers them,
runs them all on its `Fleet` at once (so a group's samples still meet on one engine), and each
rank gets its own outputs back, in order.
"""

from __future__ import annotations

import torch.distributed as dist

from verst.engine import GenerateOutput, GenerateRequest
from verst.engines.fleet import Fleet
from verst.train import distributed


class RankedFleet:
    def __init__(self, fleet: Fleet | None) -> None:
        if (fleet is None) != (distributed.rank() != 0):
            raise ValueError("rank 0, and only rank 0, holds the fleet")
        self.fleet = fleet
        self.weight_version = 0  # every rank tracks it; rank 0's fleet holds the same

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        world = distributed.world_size()
        shares: list[list[GenerateRequest]] | None = [[] for _ in range(world)]
        dist.gather_object(requests, shares if self.fleet is not None else None, dst=0)
        answers: list[list[GenerateOutput]] | None = None
        if self.fleet is not None:
            assert shares is not None
            outputs = self.fleet.generate([r for share in shares for r in share])
            answers, start = [], 0
            for share in shares:
                answers.append(outputs[start : start + len(share)])
                start += len(share)
        mine: list[list[GenerateOutput] | None] = [None]
        dist.scatter_object_list(mine, answers, src=0)
        assert mine[0] is not None
        return mine[0]
