"""One cached forward pass over a Hugging Face causal LM, as the trainer (and its critic) run it:
explicit position ids, a 2-D attention mask and a KV cache, so a group's prompt runs once and
its responses attend to its cache. transformers renamed the cache argument
(`past_key_values` → `cache`) and `DynamicCache`'s constructor changed across versions; this
module hides which one is installed.
"""

from __future__ import annotations

import contextlib
import inspect
from functools import cache as memoize

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA's backends on CUDA for passes whose lengths change from call to call (the engine's
# prefill, the trainer's): cuDNN's builds an execution plan for every new shape on first use,
# ~100 ms for a forward and backward at 700-1,100 tokens on the H200 against 1.5 ms for the
# memory-efficient kernel (`sdpa_kernel` probe, bench/results/sdpa_shapes_h200.json); an
# engine's multi-turn run went from 3.4k to 11.5k tok/s without it
SHAPE_FREE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def shape_free_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """`SHAPE_FREE_SDPA` on CUDA, nothing elsewhere."""
    return sdpa_kernel(SHAPE_FREE_SDPA) if device.type == "cuda" else contextlib.nullcontext()


@memoize
def _forward_params(model_type: type) -> tuple[str, bool]:
    params = inspect.signature(model_type.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def cache_argument(model: torch.nn.Module) -> str:
    """The name this model's forward gives its KV-cache argument."""
    return _forward_params(type(model))[0]


def new_cache(model: torch.nn.Module) -> transformers.DynamicCache:
    if "config" in inspect.signature(transformers.DynamicCache.__init__).parameters:
        return transformers.DynamicCache(config=model.config)
    return transformers.DynamicCache()


def cached_forward(
    model: torch.nn.Module,
    input_ids_B_T: torch.Tensor,
    attention_mask_B_S: torch.Tensor,
    position_ids_B_T: torch.Tensor,
    cache: transformers.DynamicCache,
    *,
    last_only: bool = False,
) -> torch.Tensor:
    """Logits [B, T, V] (or [B, 1, V] with `last_only`) of `input_ids` appended to `cache`.

    `attention_mask_B_S` covers the cached tokens and the new ones (S = cached + T).
    """
    cache_kwarg, has_logits_to_keep = _forward_params(type(model))
    kwargs = {
        "input_ids": input_ids_B_T,
        "attention_mask": attention_mask_B_S,
        "position_ids": position_ids_B_T,
        cache_kwarg: cache,
        "use_cache": True,
    }
    if last_only and has_logits_to_keep:
        kwargs["logits_to_keep"] = 1
    with shape_free_attention(input_ids_B_T.device):
        logits = model(**kwargs).logits
    return logits[:, -1:] if last_only else logits
