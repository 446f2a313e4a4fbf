"""On the CPU, bf16 linear layers through oneDNN with their weights packed once.

`F.linear` on bf16 CPU tensors lays the weight out for oneDNN again on every call. Packing each
weight once (`torch.ops.mkldnn._reorder_linear_weight`) and calling the packed kernel measured
1.3-1.9x faster a call on the 2-core AMX VM, where the linear layers are most of a decode
step. `PackedLinears.swapped()` routes the model's bf16 `nn.Linear`s through the packed kernel
for the duration of an engine forward (a trainer sharing the model keeps `F.linear`).

A packed weight is a copy, so it must never outlive the weights it was made from: the runner
drops every packed copy whenever it is told the weights changed (each weight update and each
version bump, which is all a zero-copy colocated update does), and a weight modified in place
since it was packed (its version counter moved) is packed again before use. Float32 stays on
`F.linear`: packing measured slower there for small shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinears:
    def __init__(self, modules: list[torch.nn.Linear]) -> None:
        self.modules = modules
        self._packed: dict[int, tuple[tuple[int, int, int], torch.Tensor]] = {}

    @classmethod
    def of(cls, model: torch.nn.Module) -> PackedLinears | None:
        """The model's bf16 CPU linear layers, or None when there are none or no oneDNN."""
        modules = [
            m
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
            and m.weight.dtype == torch.bfloat16
            and m.weight.device.type == "cpu"
        ]
        return cls(modules) if modules and packing_available() else None

    def stale(self) -> None:
        """The weights changed: pack again before the next use."""
        self._packed.clear()

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        for module in self.modules:
            module.forward = _PackedForward(self, module)
        try:
            yield
        finally:
            for module in self.modules:
                del module.forward

    def packed_weight(self, module: torch.nn.Linear) -> torch.Tensor:
        weight = module.weight
        key = (id(weight), weight.data_ptr(), weight._version)
        entry = self._packed.get(id(module))
        if entry is None or entry[0] != key:
            with torch.no_grad():
                entry = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
            self._packed[id(module)] = entry
        return entry[1]


class _PackedForward:
    def __init__(self, packs: PackedLinears, module: torch.nn.Linear) -> None:
        self.packs, self.module = packs, module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if x.dtype != module.weight.dtype:  # not the engine's own call: HF's semantics
            return F.linear(x, module.weight, module.bias)
        packed = self.packs.packed_weight(module)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed, module.bias, "none", [], ""
        )
