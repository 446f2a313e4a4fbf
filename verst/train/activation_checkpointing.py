"""Activation checkpointing of the policy's decoder layers (`trainer.gradient_checkpointing`):
each layer keeps only its input for the backward and runs its forward again there, trading
about a third more compute for the activations of every layer but one.

The trainer's forwards write a KV cache (a group's prompt runs once, its responses attend to
its cache), which is why Hugging Face's own checkpointing does not serve: it turns the cache
off, since replaying a layer would append its keys to the cache a second time. Here each
checkpointed call sees `_ReplayCache` in place of the real cache: the first run appends to the
real cache as usual and remembers what was there before; the replay in the backward rebuilds
the same keys from that prefix and its recomputed new keys, and writes nothing.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

_CACHE_KWARGS = ("cache", "past_key_values")  # transformers 5.x's name, then the older one
_SDPA_ENABLED = {
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
    SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
}


class _ReplayCache:
    """The KV cache as one checkpointed layer call sees it (only `update` is called inside a
    decoder layer)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.prefix: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefix is None:  # the forward: the real cache grows
            all_keys, all_values = self.cache.update(keys, values, layer_idx, *args, **kwargs)
            cached = all_keys.shape[-2] - keys.shape[-2]
            self.prefix = (all_keys[..., :cached, :], all_values[..., :cached, :])
            return all_keys, all_values
        old_keys, old_values = self.prefix  # the backward's replay: the same keys, no write
        return torch.cat([old_keys, keys], dim=-2), torch.cat([old_values, values], dim=-2)


def _forwards_attention_backends() -> tuple[Any, Any]:
    """`checkpoint`'s `context_fn`: the replay in the backward, which runs outside the forward's
    `sdpa_kernel` scope (the trainer's passes exclude cuDNN, `shape_free_attention`), chooses
    among the SDPA backends the forward allowed; another backend saves other tensors, which
    checkpoint refuses."""
    allowed = [backend for backend, enabled in _SDPA_ENABLED.items() if enabled()]
    return contextlib.nullcontext(), sdpa_kernel(allowed)


def _checkpointed_forward(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(layer).forward
    if not torch.is_grad_enabled():
        return forward(layer, *args, **kwargs)
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = _ReplayCache(kwargs[name])
    return checkpoint(
        forward,
        layer,
        *args,
        use_reentrant=False,
        context_fn=_forwards_attention_backends,
        **kwargs,
    )


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a PEFT wrapper, or `model` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM or of its body (a PEFT wrapper too)."""
    base = base_model(model)
    layers = getattr(base, "layers", None)
    if layers is None and hasattr(base, "get_decoder"):
        layers = getattr(base.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(
            f"trainer.gradient_checkpointing: {type(base).__name__} has no decoder `layers` list"
        )
    return list(layers)


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Make every decoder layer of `model` recompute its activations in the backward; returns
    how many layers. The layer's `forward` is replaced on the instance (a method bound to the
    layer, so a deep copy of the model binds to the copy) and module hooks, FSDP2's gathers,
    run around it once rather than again in the replay."""
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer.forward, "__func__", None) is not _checkpointed_forward:
            layer.forward = types.MethodType(_checkpointed_forward, layer)
    return len(layers)
