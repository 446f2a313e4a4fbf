"""On the CPU, bf16 linear layers through oneDNN with their weights packed once.

`F.linear` on bf16 CPU tensors lays the weight out for oneDNN again on every call. Packing each
weight once (`torch.ops.mkldnn._reorder_linear_weight`) and calling the packed kernel measured
1.3-1.9x faster a call on the 2-core AMX VM, where the linear layers are most of a decode
step. `PackedLinears.swapped()` routes the model's bf16 `nn.Linear`s through the packed kernel
for the duration of an engine forward (a trainer sharing the model keeps `F.linear`).

A packed weight is a copy, so it must never outlive the weights it was made from: the runner
marks every packed copy stale whenever it is told the weights changed (each weight update and
each version bump, which is all a zero-copy colocated update does), and a weight modified in
place since it was packed (its version counter moved) is packed again before use. Float32 stays on
`F.linear`: packing measured slower there for small shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

T = TypeVar("T")


@cache
def packing_available() -> bool:
    """Whether oneDNN can pack bf16 weights on this CPU: it needs avx_ne_convert or AVX-512
    (BW, VL, DQ), which e.g. AMD EPYC CPUs before Zen 4 lack; probed once with a tiny weight.
    Without it bf16 linears run as plain `F.linear`."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        packed = pack_weight(torch.zeros(8, 8, dtype=torch.bfloat16))
        packed_linear(torch.zeros(1, 8, dtype=torch.bfloat16), packed, None)
    except RuntimeError:
        return False
    return True


def packable(weight: torch.Tensor) -> bool:
    """Whether a linear weight runs faster packed: bf16 on the CPU, with oneDNN."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and packing_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] bf16 weight laid out once for oneDNN's linear kernel."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` with a weight from `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class DerivedWeights:
    """Copies made from model weights (packed, concatenated, quantized), each kept until one of
    its source tensors changes: replaced (identity or storage) or written in place (version
    counter). A copy is a tensor, or a tuple of tensors (a quantized weight and its scales)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple | None, Any]] = {}

    def stale(self) -> None:
        """The weights changed: make every copy again before its next use."""
        self._entries = {name: (None, copy) for name, (_, copy) in self._entries.items()}

    def get(
        self,
        name: str,
        sources: list[torch.Tensor],
        make: Callable[[], T],
        refill: Callable[[T], None] | None = None,
    ) -> T:
        """The copy `name` of `sources`, made by `make`; once they changed, `refill` makes it
        again in the old copy's memory where given (CUDA graphs read it by address)."""
        key = tuple((id(t), t.data_ptr(), t._version) for t in sources)
        entry = self._entries.get(name)
        if entry is not None and entry[0] == key:
            return entry[1]
        if entry is not None and refill is not None:
            refill(entry[1])
            copy = entry[1]
        else:
            copy = make()
        self._entries[name] = (key, copy)
        return copy

    def tensors(self) -> Iterator[torch.Tensor]:
        for _, copy in self._entries.values():
            yield from copy if isinstance(copy, tuple) else (copy,)


class PackedLinears:
    def __init__(self, modules: list[torch.nn.Linear]) -> None:
        self.modules = modules
        self.derived = DerivedWeights()

    @classmethod
    def of(cls, model: torch.nn.Module) -> PackedLinears | None:
        """The model's bf16 CPU linear layers, or None when there are none or no oneDNN."""
        modules = [
            m for m in model.modules() if isinstance(m, torch.nn.Linear) and packable(m.weight)
        ]
        return cls(modules) if modules else None

    def stale(self) -> None:
        """The weights changed: pack again before the next use."""
        self.derived.stale()

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
        return self.derived.get(str(id(module)), [weight], lambda: pack_weight(weight))


class _PackedForward:
    def __init__(self, packs: PackedLinears, module: torch.nn.Linear) -> None:
        self.packs, self.module = packs, module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if x.dtype != module.weight.dtype:  # not the engine's own call: HF's semantics
            return F.linear(x, module.weight, module.bias)
        return packed_linear(x, self.packs.packed_weight(module), module.bias)
