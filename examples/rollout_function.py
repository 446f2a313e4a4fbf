"""An example rollout function for `rollout.function: examples.rollout_function:skip_solved`.

A rollout function owns a whole step. This one draws the step's prompts, generates and scores
them with the run's engine and reward (`context.generate`, `context.score`), and drops the
groups every sample of which already got full reward ("solved": nothing left to learn), then
the run's `rollout.filter` if one is set. It draws again, up to three times, to fill the batch
with unsolved prompts. With `request.prompts` set (an evaluation) it generates and scores
those prompts and drops nothing.
"""

from __future__ import annotations

from verst.plugins import RolloutContext, RolloutRequest, RolloutResult
from verst.types import Group

MAX_ROUNDS = 3


def skip_solved(context: RolloutContext, request: RolloutRequest) -> RolloutResult:
    if request.prompts is not None:
        groups = context.generate(request.prompts)
        context.score(groups)
        return RolloutResult(groups)
    kept: list[Group] = []
    dropped: list[tuple[Group, str]] = []
    rounds = 0
    while len(kept) < context.prompts_per_step and rounds < MAX_ROUNDS:
        rounds += 1
        groups = context.generate(context.take(context.prompts_per_step - len(kept)))
        context.score(groups)
        for group in groups:
            reason = "solved" if all(s.reward == 1.0 for s in group) else None
            if reason is None and context.keep is not None:
                reason = context.keep(group)
            (kept.append(group) if reason is None else dropped.append((group, reason)))
    if not kept:  # train on the last draw rather than skip the step (zero advantages)
        kept, dropped = groups, dropped[: -len(groups)]
    metrics = {"rollout/skip_solved_rounds": float(rounds)}
    return RolloutResult(kept, metrics, dropped)
