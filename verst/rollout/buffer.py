"""The data buffer of fully asynchronous RL: finished groups wait here until the trainer takes them.

A buffer has exactly three operations (the `verst.plugins.Buffer` contract):

- `await put(group)`: the rollout worker hands over a finished, scored group. Blocks while the
  buffer is full, which throttles the worker.
- `await take(n_groups, current_version)`: the trainer asks for one batch; waits until
  `n_groups` acceptable groups are there.
- `metrics()`: a flat dict of `buffer/*` values for the step's log line.

`DataBuffer` is the built-in one: bounded (capacity in groups, typically a factor × the train
batch), serving the oldest groups first (those whose oldest token is from the oldest weights,
the first to go stale; in put order among equals), and it drops groups at three points:

- **aborted** (checked at put): no sample can be trained, every one ABORTED (its trajectory
  incomplete) or FAILED (its reward failed). A group with some such samples and enough others
  is kept: the trainer leaves those samples out (`verst.loop.only_scored`), and the rollout
  worker sets aside, before the buffer, a group with fewer than `rollout.min_scored_samples`
  trainable samples, as the synchronous loop does;
- **filter-rejected** (checked at put): the filter (e.g. DAPO's "rewards not all equal") said no;
  these prompts are never recycled, since they would most likely be rejected again;
- **stale** (checked at take): staleness = `current_version` − the oldest weight version of any
  token in the group (pessimistic, `verst.types.group_staleness`); a group is dropped when its
  staleness exceeds `max_staleness`. Every waiting group is checked at each take, not just the
  ones served: versions only grow, so a stale group never becomes fresh again. This rule is
  the safety net: the rollout worker makes a take wait for the groups still generating that
  would otherwise go stale (`verst.rollout.async_worker`, due groups), so with the default
  order it seldom drops one.

A put blocked on a full buffer does not hide its group from a take: a take chooses among the
waiting groups and then those blocked at put (a group served or dropped there returns its put),
so the oldest group is served even when it finished after the buffer filled up.

Aborted and stale groups go to `give_back` (the DataSource's, when `unused: retry`) so their
prompts are served again; with `give_back=None` (`unused: drop`) they are discarded.

Any other buffer is named by import path (`"pkg.mod:MyBuffer"`) and built by `make_buffer` with
the keyword arguments of `DataBuffer.__init__` (see `BUFFER_KWARGS`). The simplest way to write
one is to subclass `DataBuffer` and override `select` (which waiting groups a take serves);
`examples/custom_buffer.py` serves the freshest groups first.

`Lengths` counts response lengths (mean, quantiles, truncated share) for the `buffer/generated_*`
metrics, and for anyone comparing them with what was trained.

All methods are meant to be called from one event loop (the rollout worker's).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from verst.plugin_loader import PluginError, check_plugin, load_plugin
from verst.plugins import Buffer
from verst.types import Group, Status, group_staleness

GiveBack = Callable[[list[Group]], None]
GroupFilter = Callable[[Group], bool]

FIELD = "rollout.buffer"
DEFAULT_BUFFER = "verst.rollout.buffer:DataBuffer"
BUFFER_KWARGS = ("capacity", "max_staleness", "give_back", "group_filter")
"""The keyword arguments `make_buffer` passes to a buffer class (a custom one may take **kwargs)."""


def is_aborted(group: Group) -> bool:
    """No sample of `group` can be trained (every one ABORTED or FAILED)."""
    return not any(sample.scored for sample in group)


class DataBuffer:
    """Bounded queue of groups, oldest first, with the aborted / filtered / stale drop rules
    (module docstring).

    Metrics (`metrics()`):

    - `buffer/queue_size`, `buffer/capacity`: groups waiting now, and the bound;
    - `buffer/dropped_{aborted,filtered,stale}`: **cumulative** counts since the buffer was made
      (the per-step count is the difference between consecutive steps); also cumulative
      `buffer/put_groups` (accepted at put) and `buffer/taken_groups`;
    - `buffer/staleness_{mean,max}`: over the groups served by the last take;
    - `buffer/generated_response_len_{mean,p50,p90,max}`, `buffer/generated_truncated_ratio`:
      response tokens of every scored sample put so far, and the share TRUNCATED (at
      max_new_tokens or max_seq_len); `buffer/dropped_stale_response_len_mean`: of those
      dropped as stale (the trained ones are `rollout/response_len_mean`);
    - `buffer/waiting_staleness_{mean,max}`: over the groups still waiting, at the last take's
      version (0 when none wait);
    - `buffer/take_wait_s`: how long the last take waited for groups;
    - `buffer/rollout_bound`, `buffer/trainer_bound` (0 or 1) and `buffer/advisory` (text,
      present only when one is 1): over the last `advisory_window` takes, the trainer had to
      wait every time (rollout-bound: the queue is pinned at 0), or the buffer was full every
      time it was called (trainer-bound: the queue is pinned at capacity).

    Staleness that cannot be known (a group with no recorded weight versions) is never dropped
    and is left out of the staleness means.
    """

    def __init__(
        self,
        capacity: int,
        *,
        max_staleness: int | None = None,
        give_back: GiveBack | None = None,
        group_filter: GroupFilter | None = None,
        advisory_window: int = 5,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 group, got {capacity}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        if advisory_window < 1:
            raise ValueError(f"advisory_window must be >= 1, got {advisory_window}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.give_back = give_back
        self.group_filter = group_filter
        self.advisory_window = advisory_window
        self._waiting: list[Group] = []
        self._blocked: list[Group] = []  # groups whose put waits for room, in put order
        self._changed = asyncio.Condition()
        self.dropped_aborted = 0
        self.dropped_filtered = 0
        self.dropped_stale = 0
        self.put_groups = 0
        self.taken_groups = 0
        # response tokens and samples of every scored group that arrived, and of the stale ones
        # dropped: what the engines generated, beside what training got (a length bias shows)
        self._generated = Lengths()
        self._stale = Lengths()
        self._last_version: int | None = None
        self._last_staleness: list[int] = []
        self._last_wait_s = 0.0
        # per take: (had to wait, was full when called)
        self._recent: deque[tuple[bool, bool]] = deque(maxlen=advisory_window)

    def __len__(self) -> int:
        return len(self._waiting)

    # -- the three operations ------------------------------------------------------------------

    async def put(self, group: Group) -> None:
        if not group:
            raise ValueError("cannot put an empty group")
        if is_aborted(group):
            self.dropped_aborted += 1
            self._unused([group])
            return
        self._generated.add(group)
        if self.group_filter is not None and not self.group_filter(group):
            self.dropped_filtered += 1
            return
        async with self._changed:
            self.put_groups += 1
            if len(self._waiting) >= self.capacity:
                # a take may serve (or drop) it from here while the put waits for room
                self._blocked.append(group)
                try:
                    await self._changed.wait_for(
                        lambda: (
                            not _holds(self._blocked, group) or len(self._waiting) < self.capacity
                        )
                    )
                except asyncio.CancelledError:  # a cancelled put adds nothing
                    if _holds(self._blocked, group):
                        self._blocked.pop(_index(self._blocked, group))
                        self.put_groups -= 1
                    raise
                if not _holds(self._blocked, group):
                    return  # a take served it or dropped it
                self._blocked.pop(_index(self._blocked, group))
            self._waiting.append(group)
            self._changed.notify_all()

    async def take(self, n_groups: int, current_version: int) -> list[Group]:
        if not 1 <= n_groups <= self.capacity:
            raise ValueError(
                f"cannot take {n_groups} groups from a buffer of capacity {self.capacity}"
            )
        start = time.monotonic()
        async with self._changed:
            full_at_call = len(self._waiting) >= self.capacity
            waited = False
            while True:
                if self._drop_stale(current_version):
                    self._changed.notify_all()  # room for blocked puts
                if len(self._waiting) + len(self._blocked) >= n_groups:
                    break
                waited = True
                await self._changed.wait()
            candidates = self._waiting + self._blocked
            indices = self.select(candidates, n_groups, current_version)
            chosen = self._remove(candidates, indices, n_groups)
            self.taken_groups += n_groups
            self._changed.notify_all()
        self._last_wait_s = time.monotonic() - start
        self._last_version = current_version
        self._last_staleness = _known_staleness(chosen, current_version)
        self._recent.append((waited, full_at_call))
        return chosen

    def metrics(self) -> dict[str, Any]:
        waiting = (
            _known_staleness(self._waiting, self._last_version)
            if self._last_version is not None
            else []
        )
        rollout_bound, trainer_bound = self._bound()
        out: dict[str, Any] = {
            "buffer/queue_size": float(len(self._waiting)),
            "buffer/capacity": float(self.capacity),
            "buffer/dropped_aborted": float(self.dropped_aborted),
            "buffer/dropped_filtered": float(self.dropped_filtered),
            "buffer/dropped_stale": float(self.dropped_stale),
            "buffer/put_groups": float(self.put_groups),
            "buffer/taken_groups": float(self.taken_groups),
            "buffer/staleness_mean": _mean(self._last_staleness),
            "buffer/staleness_max": float(max(self._last_staleness, default=0)),
            "buffer/waiting_staleness_mean": _mean(waiting),
            "buffer/waiting_staleness_max": float(max(waiting, default=0)),
            "buffer/take_wait_s": self._last_wait_s,
            "buffer/generated_response_len_mean": self._generated.mean(),
            "buffer/generated_response_len_p50": float(self._generated.quantile(0.5)),
            "buffer/generated_response_len_p90": float(self._generated.quantile(0.9)),
            "buffer/generated_response_len_max": float(self._generated.quantile(1.0)),
            "buffer/generated_truncated_ratio": self._generated.truncated_ratio(),
            "buffer/dropped_stale_response_len_mean": self._stale.mean(),
            "buffer/rollout_bound": float(rollout_bound),
            "buffer/trainer_bound": float(trainer_bound),
        }
        n = self.advisory_window
        if rollout_bound:
            out["buffer/advisory"] = (
                f"rollout-bound: the trainer waited for groups at each of the last {n} steps "
                "(queue pinned at 0); more generation capacity (engines, max_inflight) would help"
            )
        elif trainer_bound:
            out["buffer/advisory"] = (
                f"trainer-bound: the buffer was full at each of the last {n} steps (queue pinned "
                "at capacity); generation waits for the trainer, so fewer engines would do, and "
                "a smaller buffer_factor would lower staleness"
            )
        return out

    # -- hooks and helpers ---------------------------------------------------------------------

    def select(self, waiting: list[Group], n_groups: int, current_version: int) -> list[int]:
        """Indices into `waiting` of the `n_groups` to serve. `waiting` holds the groups in put
        order (none stale), those still blocked at put last.

        The default serves the oldest first: the smallest oldest weight version (the group
        that goes stale first), in put order among equals, groups of unknown version last.
        Override to change the order.
        """

        def oldest(i: int) -> float:
            versions = [v for sample in waiting[i] for v in sample.weight_versions]
            return min(versions) if versions else float("inf")

        return sorted(range(len(waiting)), key=lambda i: (oldest(i), i))[:n_groups]

    def _remove(self, candidates: list[Group], indices: list[int], n_groups: int) -> list[Group]:
        if (
            len(set(indices)) != n_groups
            or len(indices) != n_groups
            or not all(0 <= i < len(candidates) for i in indices)
        ):
            raise RuntimeError(
                f"select returned {indices}, expected {n_groups} distinct indices "
                f"below {len(candidates)}"
            )
        chosen = [candidates[i] for i in indices]
        self._waiting = [g for g in self._waiting if not _holds(chosen, g)]
        self._blocked = [g for g in self._blocked if not _holds(chosen, g)]
        return chosen

    def _drop_stale(self, current_version: int) -> bool:
        if self.max_staleness is None:
            return False

        def is_stale(group: Group) -> bool:
            staleness = group_staleness(group, current_version)
            return staleness is not None and staleness > self.max_staleness

        stale = [g for g in self._waiting + self._blocked if is_stale(g)]
        if not stale:
            return False
        self._waiting = [g for g in self._waiting if not is_stale(g)]
        self._blocked = [g for g in self._blocked if not is_stale(g)]
        self.dropped_stale += len(stale)
        for group in stale:
            self._stale.add(group)
        self._unused(stale)
        return True

    def _unused(self, groups: list[Group]) -> None:
        if self.give_back is not None:
            self.give_back(groups)

    def _bound(self) -> tuple[bool, bool]:
        if len(self._recent) < self.advisory_window:
            return False, False
        return all(w for w, _ in self._recent), all(f for _, f in self._recent)


class Lengths:
    """The response lengths of the scored samples added (cumulative): a count per length, so
    quantiles are exact and memory is bounded by the distinct lengths."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.tokens = 0
        self.samples = 0
        self.truncated = 0

    def add(self, group: Group) -> None:
        for sample in group:
            if sample.scored:
                self.add_length(sample.response_length, sample.status == Status.TRUNCATED)

    def add_length(self, length: int, truncated: bool = False) -> None:
        self.counts[length] += 1
        self.tokens += length
        self.samples += 1
        self.truncated += truncated

    def mean(self) -> float:
        return self.tokens / self.samples if self.samples else 0.0

    def quantile(self, q: float) -> int:
        """The smallest length with at least a share `q` of the samples at or below it (nearest
        rank: 0.5 the median, 1.0 the longest); 0 when empty."""
        need, seen = max(1, math.ceil(q * self.samples - 1e-9)), 0
        for length in sorted(self.counts):
            seen += self.counts[length]
            if seen >= need:
                return length
        return 0

    def truncated_ratio(self) -> float:
        return self.truncated / self.samples if self.samples else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "mean": self.mean(),
            "p50": float(self.quantile(0.5)),
            "p90": float(self.quantile(0.9)),
            "max": float(self.quantile(1.0)),
            "truncated_ratio": self.truncated_ratio(),
            "samples": float(self.samples),
        }


def _holds(groups: list[Group], group: Group) -> bool:
    return any(g is group for g in groups)


def _index(groups: list[Group], group: Group) -> int:
    return next(i for i, g in enumerate(groups) if g is group)


def _known_staleness(groups: list[Group], version: int) -> list[int]:
    values = (group_staleness(g, version) for g in groups)
    return [s for s in values if s is not None]


def _mean(values: list[int]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def load_buffer_class(path: str) -> Callable[..., Buffer]:
    """The buffer class (or factory) named by `path` ('pkg.mod:MyBuffer'); a class must have the
    `verst.plugins.Buffer` methods. `PluginError` naming `rollout.buffer` otherwise."""
    factory = load_plugin(path, Buffer, field=FIELD)
    if not callable(factory):
        raise PluginError(
            f"{FIELD}: {path!r} is a {type(factory).__name__} object, not a class or factory"
        )
    return factory


def make_buffer(
    path: str,
    *,
    capacity: int,
    max_staleness: int | None,
    give_back: GiveBack | None,
    group_filter: GroupFilter | None,
) -> Buffer:
    """Build the buffer named by `path` with the `BUFFER_KWARGS`, and check its interface."""
    buffer = load_buffer_class(path)(
        capacity=capacity,
        max_staleness=max_staleness,
        give_back=give_back,
        group_filter=group_filter,
    )
    check_plugin(buffer, Buffer, field=FIELD, path=path)
    return buffer
