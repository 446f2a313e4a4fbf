"""Slot accounting of the fully async rollout worker: a pure state machine.

`Slots` owns the counting rules of `verst.rollout.async_worker.RolloutWorker`: the places each
group holds out of `max_inflight`, the puts in progress, the groups drawn and not yet served, and
from these the one question the worker's scheduler asks: may a new group start now? It owns no
tasks, no clients and no clock. The worker tells it each event with one method call; a call that
does not fit the group's phase raises `SlotError`, so a bookkeeping slip fails at the event that
caused it instead of leaving a counter off by one.

A group, keyed by the int `start()` returns, goes through these phases:

    start() ─► GENERATING ─(finish_sample() × n)─► SCORING ─put_begin()─► PUTTING
    PUTTING ─put_end()─► BUFFERED ─forget()─► gone       served by a take, or dropped stale
    PUTTING ─forget()─► RELEASED_IN_PUT ─put_end()─► gone dropped at put: aborted or filtered
    GENERATING, SCORING, PUTTING, RELEASED_IN_PUT ─abort()─► gone          stopped or failed

`forget` is the buffer letting go of a group, whatever the reason (a take served it; it was
dropped as filtered, as aborted and its prompt given back to be retried, or as stale); the
buffer reports that before the put returns when it drops a group at put.

Places: a group takes `n_samples_per_prompt` places when it starts, and the replacement rule says
when it gives them up:

- `sample`: each trajectory frees its place as it leaves generate_sample, except the group's
  last, which the group holds while it is scored (SCORING): a long-tailed trajectory holds one
  place, not its group's;
- `group`: a group holds all its places until it is handed to the buffer (`put_begin`).

A group may start (`may_start`) when no put is in progress (once the buffer is full, generation
drains instead of racing ahead of the trainer), at least `n_samples_per_prompt` places are free,
and, with `max_ahead`, fewer than `max_ahead` groups are ahead: drawn and not yet served
(generating, at put, or buffered). A group with that many ahead of it could only be served stale.
`put_begin` frees a group's last places and marks its put in progress in one transition, so no
observer sees the places free while the put is not yet counted.

Deadlines (`due`): each group remembers the weight version it started at, the version of the
latest take (`see_version`): the loop pushes a version to the engines before it takes at it, so
every token of the group is at least that new, and a group started at version w can be served
stale-free by the takes at w … w + max_staleness (its deadline). Each take serves
`n_groups`; for every group ahead to make its deadline, the takes at V … V + j can serve at most
(j + 1) × n_groups of the groups due by V + j, so the take at V must serve
max_j(#{deadline ≤ V + j} − j × n_groups) of them, the earliest deadlines first (earliest
deadline first is optimal for this). `due` names those not yet handed to the buffer: the take
waits for them. With at most max(max_staleness, 1) batches ahead the count starts at most one
batch, and a take that serves the groups it must (the buffer's default order, oldest first,
does) leaves it so for the next take: by induction over takes, no group goes stale. The start
version is a lower bound (a group started between a push and the next take is a version
newer), so a deadline is never later than the true one: at worst a take waits early.

Invariants, true after every transition (`check()` recomputes them from the groups):

- places held ≤ `max_inflight`, and groups ahead ≤ `max_ahead`;
- a GENERATING group has 1..n trajectories generating, any other group none, and `generating`
  is their sum;
- every group started has either not returned from its put yet, or was put, or was aborted:
  `groups_started = inflight_groups + groups_put + groups_aborted`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

Replacement = Literal["group", "sample"]


class SlotError(RuntimeError):
    """A transition that does not fit the group's phase: a bookkeeping bug in the caller."""


class Phase(enum.Enum):
    GENERATING = "generating"  # some of its trajectories are inside generate_sample
    SCORING = "scoring"  # all generated; the reward function runs
    PUTTING = "putting"  # inside buffer.put (blocked while the buffer is full)
    RELEASED_IN_PUT = "released_in_put"  # the buffer let go of it before its put returned
    BUFFERED = "buffered"  # accepted by the buffer, waiting for a take


BEFORE_PUT = frozenset({Phase.GENERATING, Phase.SCORING})
"""Not yet handed to the buffer."""
IN_PUT = frozenset({Phase.PUTTING, Phase.RELEASED_IN_PUT})
AHEAD = frozenset({Phase.GENERATING, Phase.SCORING, Phase.PUTTING, Phase.BUFFERED})
"""Drawn and not yet served nor dropped."""
ABORTABLE = BEFORE_PUT | IN_PUT
"""Still the worker's: its put has not returned."""


@dataclass
class _Group:
    phase: Phase
    generating: int  # its trajectories inside generate_sample
    start_version: int | None  # the latest take's version when it started; None before any


class Slots:
    """The worker's places, puts and groups ahead (module docstring); one method per event."""

    def __init__(
        self,
        *,
        n_samples_per_prompt: int,
        max_inflight: int,
        replacement: Replacement = "sample",
        max_ahead: int | None = None,
    ) -> None:
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        if max_inflight < n_samples_per_prompt:
            raise ValueError(
                f"max_inflight ({max_inflight}) must be at least n_samples_per_prompt "
                f"({n_samples_per_prompt}): a group needs that many places to start"
            )
        if replacement not in ("group", "sample"):
            raise ValueError(f"replacement must be 'group' or 'sample', got {replacement!r}")
        if max_ahead is not None and max_ahead < 1:
            raise ValueError(f"max_ahead must be >= 1 group, got {max_ahead}")
        self.n_samples_per_prompt = n_samples_per_prompt
        self.max_inflight = max_inflight
        self.replacement: Replacement = replacement
        self.max_ahead = max_ahead
        self.groups_started = 0
        self.groups_put = 0  # puts returned, whether the buffer kept the group or dropped it
        self.groups_aborted = 0
        self._groups: dict[int, _Group] = {}
        self._in_phase = dict.fromkeys(Phase, 0)
        self._generating = 0
        self._next_key = 0
        self.version: int | None = None  # the latest take's version

    # -- queries -------------------------------------------------------------------------------

    @property
    def generating(self) -> int:
        """Trajectories inside generate_sample."""
        return self._generating

    @property
    def occupied(self) -> int:
        """Places held under the replacement rule (at most `max_inflight`)."""
        if self.replacement == "sample":
            return self._generating + self._in_phase[Phase.SCORING]
        return self._count(BEFORE_PUT) * self.n_samples_per_prompt

    @property
    def putting(self) -> int:
        """Groups inside buffer.put."""
        return self._count(IN_PUT)

    @property
    def ahead(self) -> int:
        """Groups drawn and not yet served nor dropped: generating, at put, or buffered."""
        return self._count(AHEAD)

    @property
    def inflight_groups(self) -> int:
        """Groups started whose put has not returned."""
        return self._count(ABORTABLE)

    def phase(self, key: int) -> Phase | None:
        """The group's phase; None once it is gone (or for a key never started)."""
        group = self._groups.get(key)
        return None if group is None else group.phase

    def may_start(self) -> bool:
        """Whether a new group may start now."""
        if self.putting:
            return False
        if self.max_ahead is not None and self.ahead >= self.max_ahead:
            return False
        return self.max_inflight - self.occupied >= self.n_samples_per_prompt

    def start_version(self, key: int) -> int | None:
        """The version the group started at (`see_version`); None before the first take."""
        group = self._groups.get(key)
        return None if group is None else group.start_version

    def due(self, version: int, max_staleness: int, n_groups: int) -> list[int]:
        """Keys of the groups still generating or scored (not yet handed to the buffer) that
        the take at `version`, serving `n_groups`, must serve for every group ahead to be
        served by its deadline (module docstring), earliest deadline first."""
        # among equal deadlines, the groups already handed over first: serving any of them
        # meets the count, and those need no wait
        deadlines = sorted(
            (group.start_version + max_staleness, group.phase in BEFORE_PUT, key)
            for key, group in self._groups.items()
            if group.phase in AHEAD
            and group.start_version is not None
            and group.start_version + max_staleness >= version  # else lost already
        )
        must = 0
        for i, (deadline, _, _) in enumerate(deadlines):
            must = max(must, i + 1 - (deadline - version) * n_groups)
        return [key for _, before_put, key in deadlines[: min(must, n_groups)] if before_put]

    # -- transitions ---------------------------------------------------------------------------

    def see_version(self, version: int) -> None:
        """A take at `version` began: groups started from now on carry it as their start
        version, and those started before the first take get it too (the engines hold the
        first take's version from the start)."""
        if self.version is None:
            for group in self._groups.values():
                group.start_version = version
        self.version = version if self.version is None else max(self.version, version)

    def start(self) -> int:
        """A new group starts generating its `n_samples_per_prompt` trajectories; its key."""
        if not self.may_start():
            raise SlotError(
                f"no group may start: {self.occupied}/{self.max_inflight} places held, "
                f"{self.putting} puts in progress, {self.ahead} groups ahead "
                f"(max {self.max_ahead})"
            )
        key = self._next_key
        self._next_key += 1
        n = self.n_samples_per_prompt
        self._groups[key] = _Group(Phase.GENERATING, n, self.version)
        self._in_phase[Phase.GENERATING] += 1
        self._generating += n
        self.groups_started += 1
        return key

    def finish_sample(self, key: int) -> None:
        """One of the group's trajectories left generate_sample (done, failed or cancelled);
        after its last, the group is SCORING."""
        group = self._expect(key, "finish a sample of", Phase.GENERATING)
        group.generating -= 1
        self._generating -= 1
        if group.generating == 0:
            self._move(group, Phase.SCORING)

    def put_begin(self, key: int) -> None:
        """The scored group is handed to buffer.put: its last places are free, and no group
        starts until the put returns."""
        self._move(self._expect(key, "put", Phase.SCORING), Phase.PUTTING)

    def put_end(self, key: int) -> None:
        """The group's put returned: the buffer holds it, or had already let go of it."""
        group = self._expect(key, "end the put of", *IN_PUT)
        self.groups_put += 1
        if group.phase is Phase.PUTTING:
            self._move(group, Phase.BUFFERED)
        else:
            self._remove(key, group)

    def forget(self, key: int) -> None:
        """The buffer let go of the group: served by a take, or dropped (aborted, filtered,
        stale). It is no longer ahead."""
        group = self._expect(key, "forget", Phase.PUTTING, Phase.BUFFERED)
        if group.phase is Phase.PUTTING:
            self._move(group, Phase.RELEASED_IN_PUT)
        else:
            self._remove(key, group)

    def abort(self, key: int) -> bool:
        """The group is abandoned before its put returned (the worker stopped or failed); its
        places and put are released. True when it was still unconsumed (its prompts are to be
        given back), False when the buffer had already let go of it."""
        group = self._expect(key, "abort", *ABORTABLE)
        unconsumed = group.phase is not Phase.RELEASED_IN_PUT
        self._generating -= group.generating
        self._remove(key, group)
        self.groups_aborted += 1
        return unconsumed

    # -- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        """Recompute every count from the groups and raise SlotError if an invariant fails."""
        in_phase = dict.fromkeys(Phase, 0)
        n = self.n_samples_per_prompt
        for key, group in self._groups.items():
            in_phase[group.phase] += 1
            low, high = (1, n) if group.phase is Phase.GENERATING else (0, 0)
            if not low <= group.generating <= high:
                raise SlotError(f"group {key}: {group.generating} generating while {group.phase}")
        broken = []
        if in_phase != self._in_phase:
            broken.append(f"phase counts {self._in_phase} != {in_phase}")
        if self._generating != sum(g.generating for g in self._groups.values()):
            broken.append(f"generating {self._generating} is not the groups' sum")
        if self.occupied > self.max_inflight:
            broken.append(f"{self.occupied} places held > max_inflight {self.max_inflight}")
        if self.max_ahead is not None and self.ahead > self.max_ahead:
            broken.append(f"{self.ahead} groups ahead > max_ahead {self.max_ahead}")
        if self.groups_started != self.inflight_groups + self.groups_put + self.groups_aborted:
            broken.append(
                f"started {self.groups_started} != inflight {self.inflight_groups} + put "
                f"{self.groups_put} + aborted {self.groups_aborted}"
            )
        if broken:
            raise SlotError("; ".join(broken))

    # -- helpers -------------------------------------------------------------------------------

    def _count(self, phases: frozenset[Phase]) -> int:
        return sum(self._in_phase[p] for p in phases)

    def _expect(self, key: int, what: str, *phases: Phase) -> _Group:
        group = self._groups.get(key)
        if group is None:
            raise SlotError(f"cannot {what} group {key}: it is not live")
        if group.phase not in phases:
            allowed = ", ".join(p.value for p in phases)
            raise SlotError(f"cannot {what} group {key}: it is {group.phase.value}, not {allowed}")
        return group

    def _move(self, group: _Group, phase: Phase) -> None:
        self._in_phase[group.phase] -= 1
        self._in_phase[phase] += 1
        group.phase = phase

    def _remove(self, key: int, group: _Group) -> None:
        self._in_phase[group.phase] -= 1
        del self._groups[key]
