"""One cached forward pass over a Hugging Face causal LM, as the trainer (and its critic) run it:
explicit position ids, a 2-D attention mask and a KV cache, so a group's prompt runs once and
its responses attend to its cache. transformers renamed the cache argument
(`past_key_values` → `cache`) and `DynamicCache`'s constructor changed across versions; this
module hides which one is installed.
"""

from __future__ import annotations

import inspect
from functools import cache as memoize

import torch
import transformers


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
    logits = model(**kwargs).logits
    return logits[:, -1:] if last_only else logits
