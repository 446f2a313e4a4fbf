"""`build_rollout_worker`: a fully asynchronous rollout worker and its data buffer as the
config says, with every group they will not train routed to one place that decides its prompt's
fate (`verst.rollout.unused.UnusedGroups`: served again or dropped, and recorded in the prompt
ledger)."""

from __future__ import annotations

from typing import Any

from verst.plugins import GroupRewardFunction, RewardFunction, SampleFilter
from verst.rollout.async_config import AsyncConfig
from verst.rollout.async_worker import GenerateSample, RolloutWorker
from verst.rollout.buffer import make_buffer
from verst.rollout.ledger import Ledger
from verst.rollout.unused import UnusedGroups


def build_rollout_worker(
    cfg: AsyncConfig,
    source: Any,
    generate_sample: GenerateSample,
    reward_fn: RewardFunction | None,
    *,
    prompts_per_step: int,
    n_samples_per_prompt: int,
    group_filter: SampleFilter | None = None,
    ledger: Ledger | None = None,
    reward_timeout_s: float | None = None,
    min_scored_samples: int = 1,
    max_prompt_retries: int | None = None,
    group_reward_fn: GroupRewardFunction | None = None,
) -> RolloutWorker:
    """A worker and its buffer as `cfg` says; `source` has `take(n)` and `give_back(groups)`.

    `prompts_per_step` is the number of groups one `take` serves (the train batch); pass
    `group_filter=verst.rollout.dynamic.reward_variance` for DAPO dynamic sampling (any
    `verst.plugins.SampleFilter`: None keeps a group, a reason drops it), and `group_reward_fn`
    to score each group in one call in place of `reward_fn`. Every group the buffer drops
    (aborted at put, stale at take) or the worker sets aside (too few scored samples) is
    retried, by `cfg.unused` and `max_prompt_retries` (None: no cap), or dropped; a filtered
    group is dropped. `ledger` records those fates (the trainer records the groups it takes).
    """
    give_back = source.give_back if cfg.unused == "retry" else None
    fates = UnusedGroups(give_back, ledger, max_prompt_retries, group_filter)
    buffer = make_buffer(
        cfg.buffer,
        capacity=cfg.buffer_capacity(prompts_per_step),
        max_staleness=cfg.max_staleness,
        give_back=fates.dropped,
        group_filter=fates.accepted if group_filter is not None else None,
    )
    worker = RolloutWorker(
        source,
        buffer,
        generate_sample,
        reward_fn,
        n_samples_per_prompt=n_samples_per_prompt,
        max_inflight=cfg.inflight_limit(prompts_per_step, n_samples_per_prompt),
        replacement=cfg.replacement,
        give_back=give_back,
        max_ahead=cfg.ahead_limit(prompts_per_step),
        reward_timeout_s=reward_timeout_s,
        min_scored_samples=min_scored_samples,
        set_aside=fates.set_aside,
        group_reward_fn=group_reward_fn,
        max_staleness=cfg.max_staleness if cfg.wait_for_due else None,
    )
    fates.worker = worker
    return worker
