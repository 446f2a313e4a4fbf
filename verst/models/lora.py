"""LoRA adapters (`model.lora`), injected into a model with `peft`, and their files.

`apply_lora` replaces each targeted `nn.Linear` in place by peft's LoRA layer (the model keeps
its class, so every caller that runs an HF forward still does) and freezes everything but the
adapters. Parameters are then named `<module>.base_layer.weight` (frozen) and
`<module>.lora_A.default.weight` / `<module>.lora_B.default.weight` (trained), the same in the
trainer and in an engine that was injected with the same config, so weight sync matches them
by name.

`merged_weights` turns such a state dict back into the plain HF model's (W + scale·B·A), which
is what the KL reference, the critic and `save_pretrained` take. `save_adapter` / `load_adapter`
read and write peft's own format (`adapter_config.json`, `adapter_model.safetensors`), which
`peft.PeftModel.from_pretrained` loads; `merge_adapter_dir` is `verst model merge-lora`. peft
is imported only when LoRA is used (the `lora` extra installs it).
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from verst.configbase import ConfigBase
from verst.data.source import DataSourceConfig

if TYPE_CHECKING:
    import peft

ADAPTER = "default"  # peft's adapter name of the one adapter of a plain LoRA run
POLICY_ADAPTER = "policy"  # the name engines hold the trained adapter under (`lora_path`)
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # the key prefix peft's own files carry


class AdapterSpec(ConfigBase):
    """One adapter of a multi-LoRA run: its own prompts, reward, learning rate and optimizer,
    on the base the run shares."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="the adapter's name: requests' lora_path, its checkpoint subdirectory",
    )
    data: DataSourceConfig = Field(..., description="its training prompts")
    reward: str | None = Field(
        None, description="its reward function (import path or built-in); unset = rollout.reward"
    )
    lr: float | None = Field(None, gt=0, description="its learning rate; unset = trainer.lr")
    eval_data: DataSourceConfig | None = Field(
        None, description="its held-out prompts (eval/<name>/accuracy); unset = not evaluated"
    )


class LoraConfig(ConfigBase):
    """Low-rank adapters on the policy's linear layers; rank 0 trains every parameter."""

    rank: int = Field(0, ge=0, description="adapter rank r; 0 = LoRA off (full-parameter RL)")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapter output scales by alpha/r")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapter input while training (0 = none)"
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="module names (suffixes) that get adapters, or all-linear (all but lm_head)",
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        description="multi-LoRA: several adapters of this shape trained at once, each on its own "
        "data; empty = one adapter trained on `data`",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def names(self) -> list[str]:
        """peft's names of the adapters the policy carries."""
        return [a.name for a in self.adapters] or [ADAPTER]

    def wire_config(self) -> dict[str, Any]:
        """The adapter's shape as engines take it (peft's `adapter_config.json` keys)."""
        targets = self.target_modules
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": targets if isinstance(targets, str) else list(targets),
        }

    def peft_config(self) -> peft.LoraConfig:
        return peft_config_of({**self.wire_config(), "lora_dropout": self.dropout})


def peft_config_of(config: dict[str, Any]) -> peft.LoraConfig:
    """peft's config for an adapter described by peft's own keys (`r`, `lora_alpha`, ...)."""
    return _peft().LoraConfig(**config, bias="none")


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Inject adapters into `model` in place and freeze its base weights. Targets that match no
    module raise a ValueError naming `model.lora.target_modules`, before the model changed."""
    if not cfg.enabled:
        raise ValueError("model.lora.rank must be at least 1 to apply LoRA")
    if isinstance(cfg.target_modules, list) and not cfg.target_modules:
        raise ValueError("model.lora.target_modules is empty; name modules or use all-linear")
    try:
        with warnings.catch_warnings():  # a second adapter is what multi-LoRA asks for
            warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
            for name in cfg.names:
                _peft().inject_adapter_in_model(cfg.peft_config(), model, adapter_name=name)
    except ValueError as error:  # peft checks every module before it replaces any
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _linear(m)})
        raise ValueError(
            f"model.lora.target_modules={cfg.target_modules!r} matches no module of the model "
            f"({error}); its linear layers are named {names}"
        ) from error
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ImportError("model.lora needs the peft library: pip install 'verst[lora]'") from error
    return peft


def _linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear)


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A peft LoRA layer (told by its parts, so that code which only reads adapted models
    never imports peft)."""
    return (
        hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "scaling")
    )


def has_lora(model: torch.nn.Module) -> bool:
    return any(is_lora_layer(m) for m in model.modules())


_ADAPTER_PART = re.compile(r"\.(lora_[AB])\.([^.]+)\.")


def is_adapter(name: str, adapter: str | None = None) -> bool:
    """Whether parameter `name` belongs to an adapter (to `adapter`, when given)."""
    found = _ADAPTER_PART.search(name)
    return found is not None and (adapter is None or found.group(2) == adapter)


def set_active_adapter(model: torch.nn.Module, name: str) -> None:
    """Make `name` the adapter every LoRA layer applies (multi-LoRA: one adapter a forward);
    every adapter stays trainable, so sharded parameters never change `requires_grad`."""
    for module in model.modules():
        if is_lora_layer(module) and name in module.lora_A:
            module._active_adapter = [name]  # peft's own field: its set_adapter would freeze


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """Each adapted module's output scale (alpha / r), by module name."""
    return {
        name: float(module.scaling[ADAPTER])
        for name, module in model.named_modules()
        if is_lora_layer(module) and ADAPTER in module.scaling
    }


def adapter_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in state.items() if is_adapter(name)}


def merged_weights(
    state: dict[str, torch.Tensor], scale_by_module: dict[str, float]
) -> dict[str, torch.Tensor]:
    """The plain HF state dict of an adapted model's `state`: each adapted weight becomes
    W + scale · B @ A (in fp32), `base_layer` leaves the names, the adapters go."""
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        module, base, leaf = name.rpartition(".base_layer.")
        if not base:
            merged[name] = tensor
            continue
        if leaf == "weight" and module in scale_by_module:
            a = state[f"{module}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{module}.lora_B.{ADAPTER}.weight"].float()
            delta = scale_by_module[module] * (b @ a)
            tensor = (tensor.float() + delta).to(tensor.dtype)
        merged[f"{module}.{leaf}"] = tensor
    return merged


@functools.lru_cache(maxsize=65536)  # a push names the same few hundred tensors every time
def wire_name(name: str) -> str:
    """An adapter tensor's name as engines take it (`verst.plugins.AdapterUpdate`): peft's file
    key without its prefix (`...q_proj.lora_A.weight`)."""
    return _ADAPTER_PART.sub(r".\1.", name)


def from_wire_name(name: str, adapter: str = ADAPTER) -> str:
    """A wire name (`wire_name`) as the parameter's name in a model adapted as `adapter`."""
    return _verst_key(name, adapter)


def _peft_key(name: str) -> str:
    return PEFT_PREFIX + wire_name(name)


def _verst_key(key: str, adapter: str = ADAPTER) -> str:
    name = key.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.", f".{part}.{adapter}.")
    return name


def save_adapter(out: Path, adapters: dict[str, torch.Tensor], cfg: LoraConfig) -> None:
    """Write `adapters` (named as in the adapted model) in peft's format to directory `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {_peft_key(n): t.detach().contiguous().cpu() for n, t in adapters.items()}
    save_file(tensors, out / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
    cfg.peft_config().save_pretrained(str(out))


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG_FILE).is_file() and (path / ADAPTER_WEIGHTS_FILE).is_file()


def load_adapter(path: Path, adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """The adapter tensors of a peft directory, named as in a model `apply_lora` adapted, as
    its adapter `adapter`."""
    return {_verst_key(k, adapter): t for k, t in load_file(path / ADAPTER_WEIGHTS_FILE).items()}


def save_adapters(out: Path, adapters: dict[str, torch.Tensor], cfg: LoraConfig) -> None:
    """Every adapter of the policy in peft's format: the one adapter of a plain LoRA run in
    `out`, each adapter of a multi-LoRA run in `out/<name>`."""
    if not cfg.adapters:
        save_adapter(out, adapters, cfg)
        return
    for name in cfg.names:
        save_adapter(out / name, {n: t for n, t in adapters.items() if is_adapter(n, name)}, cfg)


def merge_adapter_dir(base: Path, adapter: Path, out: Path) -> None:
    """Write base + adapter, merged, as an ordinary HF directory (`verst model merge-lora`)."""
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"base model directory {str(base)!r} has no config.json")
    if not is_adapter_dir(adapter):
        raise FileNotFoundError(
            f"adapter directory {str(adapter)!r} needs {ADAPTER_CONFIG_FILE} and "
            f"{ADAPTER_WEIGHTS_FILE}"
        )
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    merged = _peft().PeftModel.from_pretrained(model, adapter, local_files_only=True)
    merged = merged.merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    if (base / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(base, local_files_only=True).save_pretrained(out)
