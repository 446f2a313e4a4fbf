"""LoRA adapters a serving engine holds beside its frozen base, applied in its own forward.

Owns `AdapterRegistry`: named adapters (peft's format: `lora_A` [r, in] and `lora_B` [out, r]
per targeted linear, scaled by alpha / r) in slots, and `AdapterRows`, one step's choice of
adapter per row. A step whose rows use different adapters runs them all in the same forward:
each targeted module keeps every slot's factors stacked (A as [slots * R, in], B transposed as
[slots * R, out], R the widest rank, narrower adapters zero-padded), and a row's delta is

    delta = ((x @ A_all^T) * scale_row) @ Bt_all

where `scale_row` holds the row's adapter scale on its own slot's R columns and zero on every
other slot's, so the other adapters' terms vanish exactly. That is two GEMMs a module
whatever the mix of adapters (a gathered LoRA matmul, no loop over adapters or rows), and rows
without an adapter get a zero row.

Modules of one shape (in all layers: q_proj and o_proj of every layer, say) keep their stacked
factors in one buffer of a group, [modules, slots * R, in] for A and [modules, slots * R, out]
for Bt, so loading an adapter is four copies a group, not two per module (a 0.5B model's
rank-16 adapter is 336 tensors and a per-tensor copy was most of its push).

Every adapter is checked whole (names, shapes, config) before any slot changes, so a bad one
leaves the registry as it was. Growing the stacked buffers (a first adapter, a wider rank, more
slots, a module no adapter targeted yet) bumps `structure`: the runner captures its CUDA graphs
again, since they read the buffers by address; an update of an adapter already held copies in
place and keeps them.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

from verst.models.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, PEFT_PREFIX

DEFAULT_MAX_ADAPTERS = 8
# peft adapter_config.json keys that change what an adapter computes beyond plain LoRA
_UNSUPPORTED = {
    "use_dora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "lora_bias": False,
    "bias": "none",
    "modules_to_save": [],
}


class AdapterError(ValueError):
    """An adapter the engine cannot hold or a request names one it does not hold."""


@dataclass
class _Slot:
    name: str
    index: int
    rank: int
    scale: float
    modules: frozenset[str]
    uid: int  # unique per loaded adapter: a prefix-cache namespace that is never reused
    source: str  # where it came from (a path, or "tensors")


@dataclass
class _Group:
    """The stacked factors of every held module of one shape (in_features, out_features)."""

    modules: list[str]
    a_M_K_I: torch.Tensor  # K = slots * R
    bt_M_K_O: torch.Tensor


class AdapterRegistry:
    def __init__(
        self, targets: dict[str, torch.nn.Linear], max_adapters: int = DEFAULT_MAX_ADAPTERS
    ) -> None:
        """`targets`: the linears adapters may target, by module name (HF's, e.g.
        `model.layers.0.self_attn.q_proj`)."""
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be at least 1, got {max_adapters}")
        self.targets = targets
        self.max_adapters = max_adapters
        self.slots: dict[str, _Slot] = {}
        self.width = 0  # R: columns per slot
        self.capacity = 0  # slots the stacked buffers have room for
        self.groups: dict[tuple[int, int], _Group] = {}
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module -> (A, Bt) views
        self.scale_S_K: torch.Tensor | None = None  # row per slot + a zero row for the base
        self.structure = 0
        self._uids = itertools.count(1)
        first = next(iter(targets.values()), None)
        self.device = first.weight.device if first is not None else torch.device("cpu")
        self.dtype = first.weight.dtype if first is not None else torch.float32

    @classmethod
    def of(
        cls, model: torch.nn.Module, max_adapters: int = DEFAULT_MAX_ADAPTERS
    ) -> AdapterRegistry:
        """Every `nn.Linear` of the model's decoder layers may take an adapter (not lm_head)."""
        head = model.get_output_embeddings()
        targets = {
            name: module
            for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and module is not head and ".layers." in name
        }
        return cls(targets, max_adapters)

    # --- what requests see ----------------------------------------------------------------------

    @property
    def empty(self) -> bool:
        return not self.slots

    @property
    def base_slot(self) -> int:
        """The slot index of rows without an adapter (the scale table's zero row)."""
        return self.capacity

    def slot(self, name: str) -> _Slot:
        held = self.slots.get(name)
        if held is None:
            loaded = sorted(self.slots) or "none"
            raise AdapterError(f"lora_path {name!r} is not a loaded adapter (loaded: {loaded})")
        return held

    def loaded(self) -> dict[str, str]:
        return {name: s.source for name, s in self.slots.items()}

    def rows(self, slots_B: torch.Tensor) -> AdapterRows | None:
        """One step's adapters, a slot index per row (`base_slot` for none); None when the
        engine holds no adapter."""
        if self.scale_S_K is None:
            return None
        return AdapterRows(self, self.scale_S_K.index_select(0, slots_B).unsqueeze(1))

    # --- changes --------------------------------------------------------------------------------

    def load(
        self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], source: str
    ) -> None:
        """Hold adapter `name` (a new one, or new weights for one held): `config` has peft's
        keys (`r`, `lora_alpha`, ...), `tensors` peft's names without `base_model.model.`
        (`<module>.lora_A.weight`, `<module>.lora_B.weight`). Raises AdapterError, changing
        nothing, for an adapter it cannot hold."""
        if not isinstance(name, str) or not name:
            raise AdapterError("lora_name must be a non-empty string")
        rank, scale = _rank_and_scale(name, config)
        factors = self._factors(name, rank, tensors)
        held = self.slots.get(name)
        if held is None and len(self.slots) >= self.max_adapters:
            raise AdapterError(
                f"adapter {name!r}: the engine holds {self.max_adapters} adapters already "
                f"({sorted(self.slots)}); unload one first"
            )
        index = held.index if held is not None else self._free_index()
        self._make_room(index + 1, rank, factors.keys())
        if held is not None and (held.rank, held.modules) != (rank, frozenset(factors)):
            self._clear(index)  # else every entry of the slot is written below
        self._write(index * self.width, rank, factors)
        assert self.scale_S_K is not None
        self.scale_S_K[index, index * self.width : index * self.width + rank] = scale
        uid = held.uid if held is not None else next(self._uids)
        self.slots[name] = _Slot(name, index, rank, scale, frozenset(factors), uid, source)

    def unload(self, name: str) -> None:
        held = self.slot(name)
        self._clear(held.index)
        del self.slots[name]

    def _factors(
        self, name: str, rank: int, tensors: dict[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) by module, every name and shape checked."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, _, part = key.rpartition(".lora_")
            if part not in ("A.weight", "B.weight") or module not in self.targets:
                raise AdapterError(
                    f"adapter {name!r}: tensor {key!r} is no lora_A / lora_B weight of a linear "
                    "layer of this model"
                )
            parts.setdefault(module, {})[part[0]] = tensor
        if not parts:
            raise AdapterError(f"adapter {name!r} has no tensors")
        factors = {}
        for module, ab in parts.items():
            linear = self.targets[module]
            want = {"A": (rank, linear.in_features), "B": (linear.out_features, rank)}
            for part, shape in want.items():
                got = ab.get(part)
                if got is None:
                    raise AdapterError(f"adapter {name!r}: {module}.lora_{part}.weight is missing")
                if tuple(got.shape) != shape:
                    raise AdapterError(
                        f"adapter {name!r}: {module}.lora_{part}.weight has shape "
                        f"{tuple(got.shape)}, expected {shape} (rank {rank})"
                    )
            factors[module] = (ab["A"], ab["B"])
        return factors

    def _free_index(self) -> int:
        used = {s.index for s in self.slots.values()}
        return next(i for i in itertools.count() if i not in used)

    def _write(
        self, start: int, rank: int, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Rows [start, start + rank) of every factor of `factors`' modules, group by group: one
        stack and one copy a factor, whatever the number of layers."""
        for group in self.groups.values():
            held = [(i, m) for i, m in enumerate(group.modules) if m in factors]
            if not held:
                continue
            a = self._stacked([factors[m][0] for _, m in held])
            bt = self._stacked([factors[m][1] for _, m in held]).transpose(1, 2)
            a_dst, bt_dst = (
                group.a_M_K_I[:, start : start + rank],
                group.bt_M_K_O[:, start : start + rank],
            )
            if len(held) == len(group.modules):  # the common case: no index to upload
                a_dst.copy_(a)
                bt_dst.copy_(bt)
            else:
                rows = torch.tensor([i for i, _ in held], device=self.device)
                a_dst.index_copy_(0, rows, a)
                bt_dst.index_copy_(0, rows, bt)

    def _stacked(self, factors: list[torch.Tensor]) -> torch.Tensor:
        """One tensor of the factors, on the registry's device and in its dtype (a peft
        directory is read on the CPU, often in fp32)."""
        return torch.stack(factors).to(device=self.device, dtype=self.dtype)

    def _make_room(self, capacity: int, rank: int, modules: Any) -> None:
        """Grow the stacked buffers (copying what they hold) to `capacity` slots of at least
        `rank` columns with every module in `modules`."""
        capacity, width = max(capacity, self.capacity), max(rank, self.width)
        new_modules = [m for m in modules if m not in self.weights]
        if capacity == self.capacity and width == self.width and not new_modules:
            return
        wanted: dict[tuple[int, int], list[str]] = {
            k: list(g.modules) for k, g in self.groups.items()
        }
        for module in new_modules:
            linear = self.targets[module]
            wanted.setdefault((linear.in_features, linear.out_features), []).append(module)
        groups = {}
        for (fan_in, fan_out), names in wanted.items():
            group = _Group(
                names,
                self._zeros(len(names), capacity * width, fan_in),
                self._zeros(len(names), capacity * width, fan_out),
            )
            old = self.groups.get((fan_in, fan_out))
            if old is not None:  # slot s keeps rows [s * width, s * width + old width)
                for new_M_K_X, old_M_K_X in (
                    (group.a_M_K_I, old.a_M_K_I),
                    (group.bt_M_K_O, old.bt_M_K_O),
                ):
                    m, x = old_M_K_X.shape[0], old_M_K_X.shape[2]
                    new_M_K_X.view(len(names), capacity, width, x)[
                        :m, : self.capacity, : self.width
                    ] = old_M_K_X.view(m, self.capacity, self.width, x)
            groups[(fan_in, fan_out)] = group
        self.groups = groups
        self.weights = {
            m: (g.a_M_K_I[i], g.bt_M_K_O[i])
            for g in groups.values()
            for i, m in enumerate(g.modules)
        }
        scale = self._zeros(capacity + 1, capacity * width)
        for held in self.slots.values():
            start = held.index * width
            scale[held.index, start : start + held.rank] = held.scale
        self.scale_S_K, self.width, self.capacity = scale, width, capacity
        self.structure += 1

    def _clear(self, index: int) -> None:
        if index >= self.capacity:
            return
        start, stop = index * self.width, (index + 1) * self.width
        for group in self.groups.values():
            group.a_M_K_I[:, start:stop].zero_()
            group.bt_M_K_O[:, start:stop].zero_()
        assert self.scale_S_K is not None
        self.scale_S_K[index].zero_()

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)


@dataclass
class AdapterRows:
    """One step's adapter per row, as each row's scale over the stacked columns [B, 1, K]."""

    registry: AdapterRegistry
    scale_B_1_K: torch.Tensor

    def delta(self, module: str, x_B_T_I: torch.Tensor) -> torch.Tensor | None:
        """The adapters' term of `module`'s output for input x, None if no adapter targets it."""
        factors = self.registry.weights.get(module)
        if factors is None:
            return None
        a_K_I, bt_K_O = factors
        return torch.matmul(F.linear(x_B_T_I, a_K_I) * self.scale_B_1_K, bt_K_O)


def _rank_and_scale(name: str, config: dict[str, Any]) -> tuple[int, float]:
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: lora_config must be an object of peft's keys")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be an int >= 1, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a number > 0, got {alpha!r}")
    for key, off in _UNSUPPORTED.items():
        if config.get(key) not in (None, off):
            raise AdapterError(f"adapter {name!r}: {key}={config[key]!r} is not supported")
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / root


def read_adapter_dir(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A peft adapter directory as (its config, its tensors named as `AdapterRegistry.load`
    takes them); AdapterError when it is not one."""
    config_file, weights_file = path / ADAPTER_CONFIG_FILE, path / ADAPTER_WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(
            f"{str(path)!r} is no peft adapter directory (it needs {ADAPTER_CONFIG_FILE} and "
            f"{ADAPTER_WEIGHTS_FILE})"
        )
    try:
        config = json.loads(config_file.read_text())
        tensors = load_file(weights_file)
    except (OSError, ValueError, SafetensorError) as error:
        raise AdapterError(f"cannot read the adapter in {str(path)!r}: {error}") from error
    return config, {key.removeprefix(PEFT_PREFIX): t for key, t in tensors.items()}
