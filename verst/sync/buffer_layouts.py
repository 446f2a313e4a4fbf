"""verst's own whole-update request: a weight update in one round trip, with the layout of the
trainer's staging buffers sent once.

SGLang's `/update_weights_from_tensor` carries one bucket per request and a pickled handle plus
every tensor's metadata each time; the version protocol around it (pause, flush, version,
continue, confirm) is five more requests. For a `verst serve` engine (and the in-process
client) `IpcBucketSender` sends instead `POST /verst/update_weights_from_buffers`:

    {"buffers": [{"layout": "<id>", "payload": "<base64 flattened_bucket pickle>"}, ...],
     "pause_mode": "retract" | "in_place" | "abort" | null,
     "flush_cache": bool, "weight_version": "<v>" | null, "continue_generation": bool,
     "release_layouts": ["<id>", ...]}

Each entry is one staging buffer filled with one bucket. A layout (which buffer, which
parameters at which byte offsets, dtypes and shapes) gets a fresh random id when the trainer
first fills a buffer that way; the first request that uses it carries the payload (SGLang's
flattened-bucket pickle), which the engine opens, checks against its parameters and keeps as a
list of (parameter, view) pairs under that id (`LayoutRegistry`). Later requests name the id
alone: the engine's work is then one `_foreach_copy_`, with nothing unpickled or opened. Any
change of the buffer or of the tensors in it makes a new id, so a stale layout can never be
applied to other bytes; an engine that no longer holds an id (restarted, or evicted) answers 409
with `unknown_layouts`, before changing anything, and the trainer sends the payloads again.

`release_layouts` (optional) names layouts of buffers the trainer has since freed (a buffer that
grew), so the engine unmaps them rather than holding the old memory until they age out.

The answer is SGLang's `{success, message}` plus the engine's `weight_version` after the update,
which is the confirmation the protocol's separate `get_version` call gave. The engine runs the
whole request between two scheduler steps (`WeightUpdates.update_weights_from_buffers`).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verst.sync.shared_tensors import SharedTensorError, check_targets, named_tensors_from_payload

BUFFERS_PATH = "/verst/update_weights_from_buffers"
# layouts an engine keeps: a push's buckets (2 for a 0.5B model, ~60 for 30B in 512 MB buckets)
HELD_LAYOUTS = 256
UNKNOWN_LAYOUT_STATUS = 409


class UnknownLayouts(SharedTensorError):
    """A request named layouts this engine does not hold (send their payloads again)."""

    def __init__(self, ids: list[str]) -> None:
        super().__init__(f"unknown buffer layouts {ids}: send their payloads again")
        self.ids = ids


@dataclass
class BufferEntry:
    """One staging buffer of a request: its layout id, and the payload when it is new."""

    layout: str
    payload: str | None = None


@dataclass
class BufferLayout:
    targets: list[torch.Tensor]  # the engine's parameters
    views: list[torch.Tensor]  # the trainer's bytes for each, views of its mapped buffer


def new_layout_id() -> str:
    return uuid.uuid4().hex


def parse_entries(raw: Any) -> list[BufferEntry]:
    """The `buffers` field of a request; ValueError with the reason for a malformed one."""
    if not isinstance(raw, list):
        raise ValueError("buffers: Field required (a list of {layout, payload?})")
    entries = []
    for item in raw:
        layout = item.get("layout") if isinstance(item, dict) else None
        payload = item.get("payload") if isinstance(item, dict) else None
        if not isinstance(layout, str) or not layout:
            raise ValueError("buffers[].layout must be a non-empty string")
        if payload is not None and (not isinstance(payload, str) or not payload):
            raise ValueError("buffers[].payload must be a base64 string when given")
        entries.append(BufferEntry(layout, payload))
    return entries


def parse_released(raw: Any) -> list[str]:
    """The `release_layouts` field: a list of layout ids (none when absent)."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ValueError("release_layouts must be a list of layout ids")
    return raw


class LayoutRegistry:
    """The engine's side: layouts by id, the most recently used `limit` of them. Holding a
    layout holds the trainer's buffer open (its views keep the mapping)."""

    def __init__(self, limit: int = HELD_LAYOUTS) -> None:
        self.limit = limit
        self._layouts: OrderedDict[str, BufferLayout] = OrderedDict()
        self._lock = threading.Lock()

    def resolve(
        self,
        entries: Sequence[BufferEntry],
        params: dict[str, torch.Tensor],
        release: Sequence[str] = (),
    ) -> list[BufferLayout]:
        """The layout of each entry, new ones opened and checked first, after letting go of the
        layouts `release` names (of buffers the trainer freed). Raises `UnknownLayouts` (naming
        every missing id) or `SharedTensorError`; either way nothing was copied."""
        with self._lock:
            for layout in release:
                self._layouts.pop(layout, None)
            for entry in entries:  # first: an unpickled payload releases the trainer's reference
                if entry.payload is not None:
                    self._layouts[entry.layout] = _open(entry.payload, params)
            missing = [e.layout for e in entries if e.layout not in self._layouts]
            if missing:
                raise UnknownLayouts(missing)
            found = []
            for entry in entries:
                self._layouts.move_to_end(entry.layout)
                found.append(self._layouts[entry.layout])
            while len(self._layouts) > max(self.limit, len(entries)):
                self._layouts.popitem(last=False)
            return found

    def __len__(self) -> int:
        return len(self._layouts)


def _open(payload: str, params: dict[str, torch.Tensor]) -> BufferLayout:
    named = named_tensors_from_payload(payload, "flattened_bucket")
    check_targets(named, params)
    return BufferLayout([params[n] for n, _ in named], [view for _, view in named])
