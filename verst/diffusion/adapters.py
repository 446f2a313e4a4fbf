"""LoRA on the diffusion transformer (`model.lora` with `model.kind: diffusion`).

The LM's adapters (`verst.models.lora`): peft's LoRA layers injected in place into the
transformer's linear layers, the base frozen. The trainer steps the adapters alone and a weight
sync carries them alone: an in-process engine copy gets them with `load_into`, a served engine
gets a peft directory (`save`) or the tensors through a broadcast group, which it applies to its
own frozen base (`apply_dir`, `apply_wire`); nothing is merged. `merged` is the plain
transformer's state dict (W + scale * B @ A), what a model without adapters loads to sample as
the adapted one does; `merge_dir` writes it as a model directory (`verst model merge-lora`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from verst.diffusion import model as tiny
from verst.models import lora
from verst.models.lora import LoraConfig

ADAPTER_DIR = "adapter"  # a LoRA checkpoint's and a disk push's peft directory


def adapt(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> None:
    """Inject `cfg`'s adapters into `model` and freeze everything else. peft draws A from
    torch's global generator: seeded here (and restored after), so a run is a function of
    its seed and a resumed run starts as the uninterrupted one did."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lora.apply_lora(model, cfg)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of an adapted model (the model's own tensors, detached)."""
    return {n: p.detach() for n, p in model.named_parameters() if lora.is_adapter(n)}


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], *, field: str) -> None:
    """Copy `state` into `model`: every adapter tensor when `state` holds adapters only, else
    the whole state dict. ValueError naming `field` when the names do not match the model's."""
    if not state or not all(lora.is_adapter(n) for n in state):
        model.load_state_dict(state)
        return
    own = adapter_state(model)
    if set(own) != set(state):
        missing, unknown = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(
            f"{field}: the adapter does not fit the model's (missing {missing[:3]}, unknown "
            f"{unknown[:3]}); was it trained with other model.lora.target_modules?"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"{field}: adapter tensor {name} has shape {tuple(tensor.shape)}, the "
                    f"model's {tuple(own[name].shape)} (another model.lora.rank?)"
                )
            own[name].copy_(tensor)


def save(directory: Path, model: torch.nn.Module, cfg: LoraConfig) -> int:
    """The model's adapters in peft's format in `directory`; returns their bytes."""
    state = adapter_state(model)
    lora.save_adapter(directory, state, cfg)
    return sum(t.numel() * t.element_size() for t in state.values())


def config_of(directory: Path) -> LoraConfig:
    """The adapter shape a peft directory was saved with."""
    return config_from_wire(json.loads((directory / lora.ADAPTER_CONFIG_FILE).read_text()))


def config_from_wire(config: dict, *, field: str = "adapter_config.json") -> LoraConfig:
    """The adapter shape from peft's keys (`LoraConfig.wire_config`); ValueError naming
    `field` when a key is missing."""
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in config]
    if missing:
        raise ValueError(f"{field}: the adapter config lacks {missing}")
    return LoraConfig(
        rank=config["r"], alpha=config["lora_alpha"], target_modules=config["target_modules"]
    )


def apply_wire(
    model: torch.nn.Module, config: dict, tensors: dict[str, torch.Tensor], *, field: str
) -> None:
    """Load adapter tensors named as engines take them (`verst.plugins.AdapterUpdate`) into
    `model`, injecting adapters of shape `config` (peft's keys) first when it carries none."""
    if not lora.has_lora(model):
        adapt(model, config_from_wire(config, field=field))
    load_into(model, {lora.from_wire_name(n): t for n, t in tensors.items()}, field=field)


def apply_dir(model: torch.nn.Module, directory: Path, *, field: str) -> None:
    """Load the peft directory `directory` into `model`, injecting its adapters first when the
    model carries none (a served engine starts from the frozen base)."""
    if not lora.is_adapter_dir(directory):
        raise ValueError(
            f"{field}: {directory} is no peft adapter directory (it needs "
            f"{lora.ADAPTER_CONFIG_FILE} and {lora.ADAPTER_WEIGHTS_FILE})"
        )
    if not lora.has_lora(model):
        adapt(model, config_of(directory))
    load_into(model, lora.load_adapter(directory), field=field)


def merged(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain transformer's state dict of an adapted model, adapters merged."""
    return lora.merged_weights(model.state_dict(), lora.scalings(model))


def merge_lora(base: Path, adapter: Path, out: Path) -> None:
    """`verst model merge-lora`: `merge_dir` when `base` is a diffusion model directory, else
    the LM's merge (`verst.models.lora.merge_adapter_dir`)."""
    if (base / tiny.META_FILE).is_file():
        merge_dir(base, adapter, out)
    else:
        lora.merge_adapter_dir(base, adapter, out)


def merge_dir(base: Path, adapter: Path, out: Path) -> None:
    """Write the diffusion model directory `base` with the adapters of `adapter` (a peft
    directory, or a LoRA checkpoint holding one in `adapter/`) merged, as a plain model
    directory `out` usable as `model.path` (`verst model merge-lora`)."""
    if not lora.is_adapter_dir(adapter) and lora.is_adapter_dir(adapter / ADAPTER_DIR):
        adapter = adapter / ADAPTER_DIR
    if not lora.is_adapter_dir(adapter):
        raise FileNotFoundError(
            f"adapter directory {str(adapter)!r} needs {lora.ADAPTER_CONFIG_FILE} and "
            f"{lora.ADAPTER_WEIGHTS_FILE} (or a LoRA checkpoint's {ADAPTER_DIR}/)"
        )
    model, _ = tiny.load(base)
    apply_dir(model, adapter, field="adapter")
    plain, _ = tiny.load(base)
    plain.load_state_dict(merged(model))
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out / "transformer")
    for name in ("scheduler", tiny.META_FILE):
        source = base / name
        if source.is_dir():
            shutil.copytree(source, out / name, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy2(source, out / name)
