"""The HF configs of the tiny model families: one function per family, from a tiny shape.

Each family is one that transformers ships and Miles names (Qwen2, Qwen3, Qwen3-MoE, Llama,
Llama-3, Mistral, Gemma-3 text, GLM-4, gpt-oss, DeepSeek-V3, and Mixtral as a second MoE). A
family's config keeps what makes the architecture itself: Llama-3's rope scaling, the sliding
windows of Mistral, Gemma-3 and gpt-oss (at `sliding_window` tokens, so short test sequences
cross them), gpt-oss's attention sinks, DeepSeek-V3's latent attention (K and V heads of
different widths) and its shared and routed experts; widths come from the tiny shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import transformers
from transformers import PretrainedConfig, PreTrainedModel

FamilyName = Literal[
    "qwen3",
    "qwen2",
    "qwen3-moe",
    "llama",
    "llama3",
    "mistral",
    "gemma3",
    "glm4",
    "gpt-oss",
    "deepseek-v3",
    "mixtral",
]


def _qwen3(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    return transformers.Qwen3Config(**common)


def _qwen2(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    return transformers.Qwen2Config(**common)


def _qwen3_moe(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.experts_per_token,
        moe_intermediate_size=shape.intermediate_size // 2,
        norm_topk_prob=True,
        **common,
    )


def _llama(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    return transformers.LlamaConfig(**common)


def _llama3(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": max(8, common["max_position_embeddings"] // 4),
    }
    return transformers.LlamaConfig(rope_parameters=rope, **common)


def _mistral(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    return transformers.MistralConfig(sliding_window=shape.sliding_window, **common)


def _gemma3(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    # every other layer slides (Gemma-3 itself: five of six); the logit soft-cap is Gemma-2's,
    # kept on so the engine's capping is exercised
    layer_types = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.num_layers)
    ]
    return transformers.Gemma3TextConfig(
        sliding_window=shape.sliding_window,
        layer_types=layer_types,
        query_pre_attn_scalar=common["head_dim"],
        final_logit_softcapping=30.0,
        **common,
    )


def _glm4(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    return transformers.Glm4Config(**common)


def _gpt_oss(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    layer_types = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.num_layers)
    ]
    # YaRN as gpt-oss has it, stretched over the tiny context
    rope = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": common["max_position_embeddings"] // 4,
    }
    return transformers.GptOssConfig(
        rope_parameters=rope,
        num_local_experts=shape.num_experts,
        num_experts_per_tok=shape.experts_per_token,
        sliding_window=shape.sliding_window,
        layer_types=layer_types,
        **common,
    )


def _deepseek_v3(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    head_dim = common.pop("head_dim")
    common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: one K/V per head
    # the first layer dense, the rest mixture-of-experts (one shared expert, no group limit)
    return transformers.DeepseekV3Config(
        q_lora_rank=shape.hidden_size // 2,
        kv_lora_rank=shape.hidden_size // 2,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=head_dim // 2,
        v_head_dim=head_dim // 2,
        n_routed_experts=shape.num_experts,
        n_shared_experts=1,
        num_experts_per_tok=shape.experts_per_token,
        moe_intermediate_size=shape.intermediate_size // 2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **common,
    )


def _mixtral(common: dict[str, Any], shape: Any) -> PretrainedConfig:
    return transformers.MixtralConfig(
        num_local_experts=shape.num_experts, num_experts_per_tok=shape.experts_per_token, **common
    )


_BUILDERS: dict[str, tuple[Callable[..., PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen3": (_qwen3, transformers.Qwen3ForCausalLM),
    "qwen2": (_qwen2, transformers.Qwen2ForCausalLM),
    "qwen3-moe": (_qwen3_moe, transformers.Qwen3MoeForCausalLM),
    "llama": (_llama, transformers.LlamaForCausalLM),
    "llama3": (_llama3, transformers.LlamaForCausalLM),
    "mistral": (_mistral, transformers.MistralForCausalLM),
    "gemma3": (_gemma3, transformers.Gemma3ForCausalLM),
    "glm4": (_glm4, transformers.Glm4ForCausalLM),
    "gpt-oss": (_gpt_oss, transformers.GptOssForCausalLM),
    "deepseek-v3": (_deepseek_v3, transformers.DeepseekV3ForCausalLM),
    "mixtral": (_mixtral, transformers.MixtralForCausalLM),
}
FAMILIES: tuple[str, ...] = tuple(_BUILDERS)
MOE_FAMILIES: tuple[str, ...] = ("qwen3-moe", "gpt-oss", "deepseek-v3", "mixtral")


def family_config(
    family: str, common: dict[str, Any], shape: Any
) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    """The HF config of a tiny `family` model from the shared fields and the tiny shape, and
    the causal-LM class that builds it."""
    build, cls = _BUILDERS[family]
    return build(dict(common), shape), cls
