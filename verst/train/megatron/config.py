"""`trainer.megatron`: the parallel layout of the Megatron-core backend, and the checks that a
layout fits the model and the world before any work starts."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from verst.configbase import ConfigBase

# HF `model_type` values the weight mapping covers (`verst.train.megatron.mapping`)
DENSE_FAMILIES = ("qwen2", "qwen3", "llama")
MOE_FAMILIES = ("qwen3_moe",)


class MegatronConfig(ConfigBase):
    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel ranks (heads, MLP, vocab)")
    pipeline_parallel: int = Field(1, ge=1, description="pipeline stages (layers split evenly)")
    expert_parallel: int = Field(1, ge=1, description="expert-parallel ranks (MoE experts split)")

    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


def check_layout(cfg: MegatronConfig, hf_config: Any, world_size: int) -> None:
    """Raise a ValueError naming the field when the layout does not divide the model or the
    world, or when the model's family is not one the mapping covers."""
    family = getattr(hf_config, "model_type", None)
    if family not in DENSE_FAMILIES + MOE_FAMILIES:
        raise ValueError(
            f"trainer.backend=megatron: model family {family!r} is not covered; one of "
            f"{', '.join(DENSE_FAMILIES + MOE_FAMILIES)} (HF model_type)"
        )
    rope = getattr(hf_config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(
            f"trainer.backend=megatron: rope scaling {rope.get('rope_type')!r} is not covered "
            "(plain RoPE only)"
        )
    tp, pp, ep = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.expert_parallel
    kv_heads = hf_config.num_key_value_heads
    _divides("trainer.megatron.tensor_parallel", tp, hf_config.num_attention_heads, "heads")
    _divides("trainer.megatron.tensor_parallel", tp, kv_heads, "key/value heads")
    _divides("trainer.megatron.pipeline_parallel", pp, hf_config.num_hidden_layers, "layers")
    if family in MOE_FAMILIES:
        _divides("trainer.megatron.expert_parallel", ep, hf_config.num_experts, "experts")
        if getattr(hf_config, "mlp_only_layers", None) or hf_config.decoder_sparse_step != 1:
            raise ValueError(
                "trainer.backend=megatron: every layer must be an MoE layer "
                "(mlp_only_layers empty, decoder_sparse_step 1)"
            )
    else:  # experts are not TP-split (expert tensor parallel is 1)
        _divides("trainer.megatron.tensor_parallel", tp, hf_config.intermediate_size, "MLP width")
    if family not in MOE_FAMILIES and ep > 1:
        raise ValueError(
            f"trainer.megatron.expert_parallel={ep} needs an MoE model; {family!r} has no experts"
        )
    model_parallel = tp * pp
    if world_size % model_parallel:
        raise ValueError(
            f"trainer.megatron: tensor_parallel × pipeline_parallel = {model_parallel} does not "
            f"divide the {world_size} ranks"
        )
    data_parallel = world_size // model_parallel
    if data_parallel % ep:
        raise ValueError(
            f"trainer.megatron.expert_parallel={ep} does not divide the {data_parallel} "
            "data-parallel ranks (world / (tensor_parallel × pipeline_parallel))"
        )


def _divides(field: str, parts: int, total: int, what: str) -> None:
    if total % parts:
        raise ValueError(f"{field}={parts} does not divide the model's {total} {what}")
