"""An example data buffer for `rollout.buffer: examples.custom_buffer:FreshestFirstBuffer`.

A buffer is built with the keyword arguments `capacity`, `max_staleness`, `give_back` and
`group_filter`, and offers `async put(group)`, `async take(n_groups, current_version)` and
`metrics()` (see `verst/rollout/buffer.py`). Subclassing the built-in `DataBuffer` keeps its
bound and its drop rules (aborted and filtered at put, stale at take) and only changes the order
in which waiting groups are served, through `select`.

This one serves the freshest groups first (those whose oldest token came from the newest
weights), so the trainer sees the least off-policy data available; older groups wait and are
eventually dropped as stale, the long ones most (they span the most versions), which biases
training toward short responses. The default serves the oldest first instead, so that, with the
rollout worker waiting for due groups, none goes stale.
"""

from __future__ import annotations

from typing import Any

from verst.rollout.buffer import DataBuffer
from verst.types import Group, group_staleness


class FreshestFirstBuffer(DataBuffer):
    def select(self, waiting: list[Group], n_groups: int, current_version: int) -> list[int]:
        def staleness(i: int) -> int:
            value = group_staleness(waiting[i], current_version)
            return 0 if value is None else value

        # least stale first; among equals, the one put first
        return sorted(range(len(waiting)), key=lambda i: (staleness(i), i))[:n_groups]

    def metrics(self) -> dict[str, Any]:
        return super().metrics() | {"buffer/order_freshest_first": 1.0}
