"""The scheduler's weights: in-place updates with a version stamp, LoRA adapters, and what a
change of weights does to the cached prefixes (a part of `Scheduler`, which holds the model,
runner, cache and requests it reads)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from verst.engine.adapters import AdapterError, AdapterRegistry
from verst.engine.running import Running

if TYPE_CHECKING:
    from verst.engine.model_runner import ModelRunner
    from verst.engine.radix_cache import RadixCache


class SchedulerWeights:
    model: torch.nn.Module
    runner: ModelRunner
    cache: RadixCache | None
    running: list[Running]
    waiting: deque[Running]
    weight_version: int | str
    _params_by_name: dict[str, torch.Tensor] | None

    if TYPE_CHECKING:  # the scheduler's (`OverlapSteps`)

        def _settle(self) -> None: ...

    @torch.no_grad()
    def update_weights_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str
    ) -> None:
        """Copy weights in place and stamp `version`. Cached prefixes hold KV of the old
        weights, so they are dropped; in-flight requests keep theirs (in_place semantics).
        Every name and shape is checked before the first copy: a bad update changes nothing."""
        self._settle()
        params = self.parameters()
        named = list(named_tensors)
        for name, tensor in named:
            if name not in params:
                raise KeyError(f"unknown parameter name: {name!r}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name!r}")
        torch._foreach_copy_([params[name] for name, _ in named], [t for _, t in named])
        self.set_weight_version(version)
        self.weights_changed()

    def adapter_registry(self) -> AdapterRegistry:
        if self.runner.adapters is None:
            raise AdapterError(
                "LoRA adapters need a model the engine's lean forward runs (Llama, Mistral, "
                "Qwen2, Qwen3); this one runs HF's layers"
            )
        return self.runner.adapters

    def load_adapter(
        self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], source: str
    ) -> None:
        """Hold LoRA adapter `name` (or its new weights), checked whole first
        (`AdapterRegistry.load`); cached prefixes computed with its old weights are dropped."""
        self._settle()
        self.adapter_registry().load(name, config, tensors, source)
        self.weights_changed()

    def unload_adapter(self, name: str) -> None:
        """Drop adapter `name`; refused while a request uses it."""
        self._settle()
        held = self.adapter_registry().slot(name)
        users = [r.request.rid for r in [*self.running, *self.waiting] if r.adapter == held.index]
        if users:
            raise AdapterError(f"adapter {name!r} is in use by {len(users)} requests")
        self.adapter_registry().unload(name)
        self.weights_changed()

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, tied ones under each name (walked once: the module tree
        does not change, and weight updates write into these very tensors)."""
        if self._params_by_name is None:
            self._params_by_name = dict(self.model.named_parameters(remove_duplicate=False))
        return self._params_by_name

    def weights_changed(self) -> None:
        """Cached prefixes hold KV of the old weights: drop every one no request is using."""
        self._settle()
        self.runner.weights_changed()
        if self.cache is not None:
            self.cache.evict(self.cache.evictable_pages())

    def set_weight_version(self, version: int | str) -> None:
        # a zero-copy colocated update changes the weights under us and only bumps the version
        self._settle()  # the pending step's tokens are the old version's
        self.runner.weights_changed()
        self.weight_version = version
