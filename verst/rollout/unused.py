"""The fates of the groups a fully asynchronous rollout worker does not deliver to a take."""

from __future__ import annotations

from typing import Protocol

from verst.plugins import SampleFilter
from verst.rollout.buffer import GiveBack, is_aborted
from verst.rollout.dynamic import drop_reason
from verst.rollout.ledger import (
    ABORTED,
    DROPPED,
    RETRIED,
    STALE,
    Fate,
    Ledger,
    filtered,
    unused_fate,
)
from verst.types import Group


class Forgets(Protocol):
    """The worker's side: a group it no longer holds (`RolloutWorker.forget`)."""

    def forget(self, groups: list[Group]) -> None: ...


class UnusedGroups:
    """What becomes of the groups the worker does not deliver to a take: the buffer's drops
    (aborted at put, stale at take) and the worker's set-asides (too few scored samples) are
    retried (their prompts given back, within `max_prompt_retries`) or dropped; groups the
    filter rejects are dropped. Each fate goes to the ledger; the worker forgets the group."""

    def __init__(
        self,
        give_back: GiveBack | None,
        ledger: Ledger | None,
        max_prompt_retries: int | None,
        group_filter: SampleFilter | None,
    ) -> None:
        self.give_back = give_back
        self.ledger = ledger
        self.max_prompt_retries = max_prompt_retries
        self.group_filter = group_filter
        self.worker: Forgets | None = None  # the worker, set once it is built

    def set_aside(self, groups: list[Group], reason: str) -> None:
        assert self.worker is not None
        self.worker.forget(groups)
        fates = []
        for group in groups:
            retry = self.give_back is not None
            fate = unused_fate(group, reason, retry=retry, max_retries=self.max_prompt_retries)
            if fate.outcome == RETRIED:
                assert self.give_back is not None
                for sample in group:
                    sample.retries = fate.retries
                self.give_back([group])
            fates.append(fate)
        if self.ledger is not None:
            self.ledger.record(fates)

    def dropped(self, groups: list[Group]) -> None:
        """The buffer's give-back: aborted or stale groups."""
        for group in groups:
            self.set_aside([group], ABORTED if is_aborted(group) else STALE)

    def accepted(self, group: Group) -> bool:
        """The buffer's filter: False drops the group (the `rollout.filter` gave a reason)."""
        assert self.worker is not None and self.group_filter is not None
        reason = drop_reason(self.group_filter, group)
        if reason is None:
            return True
        self.worker.forget([group])
        if self.ledger is not None:
            self.ledger.record([Fate.of(group, DROPPED, filtered(reason))])
        return False
