"""Megatron-core's GPTModel from an HF config, on Megatron's local layer spec (Transformer
Engine optional), with the parallel state of a `MegatronConfig` layout.

megatron-core 0.16 runs on CUDA; on a CPU four of its code paths on the way through GPTModel
name CUDA outright: RoPE moves its frequencies to `torch.cuda.current_device()`, attention
dropout forks the CUDA RNG tracker, attention scores go into a global buffer allocated on the
current CUDA device, and the default causal mask is built on "cuda" (as are its pipeline
schedules' token counters). `allow_cpu` replaces the first three with their CPU equivalents,
the trainer always passes an explicit mask and calls a single stage without a schedule, so the
very same layers run on a CPU for tests and laptops (pipeline parallelism stays CUDA-only).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from verst.train.megatron.config import MOE_FAMILIES, MegatronConfig
from verst.train.megatron.mapping import WeightMap


def init_parallel(cfg: MegatronConfig, seed: int, device: torch.device) -> None:
    """Megatron's process groups over the already initialised default group."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_parallel,
            pipeline_model_parallel_size=cfg.pipeline_parallel,
            expert_model_parallel_size=cfg.expert_parallel,
            expert_tensor_parallel_size=1,
        )
    define_te_gemm_without_te()
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(seed)
    else:
        allow_cpu()


def define_te_gemm_without_te() -> None:
    """megatron-core 0.16's MoE router gating tests `te_general_gemm is not None`, a name its
    `moe_utils` binds only when Transformer Engine imports: without TE every MoE forward is a
    NameError. Bound to None, the gating takes its own torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def transformer_config(hf: Any, dtype: torch.dtype, cfg: MegatronConfig) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    heads = hf.num_attention_heads
    moe = hf.model_type in MOE_FAMILIES
    extra: dict[str, Any] = {}
    if moe:
        extra = dict(
            num_moe_experts=hf.num_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            # softmax over the top-k logits = HF's softmax renormalised over the top k
            moe_router_pre_softmax=not hf.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",  # alltoall needs CUDA streams at build
            expert_model_parallel_size=cfg.expert_parallel,
        )
    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf, "attention_bias", False)) or hf.model_type == "qwen2",
        qk_layernorm=hf.model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tensor_parallel,
        pipeline_model_parallel_size=cfg.pipeline_parallel,
        pipeline_dtype=dtype,
        params_dtype=torch.float32,  # fp32 master weights, as the FSDP2 backend keeps
        bf16=dtype == torch.bfloat16,
        autocast_dtype=dtype if dtype != torch.float32 else None,
        use_cpu_initialization=True,
        perform_initialization=False,  # the HF weights overwrite every parameter
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **extra,
    )


def build_model(hf_config: Any, cfg: MegatronConfig, dtype: torch.dtype) -> torch.nn.Module:
    """This rank's stage of the GPTModel, fp32, on the CPU (the caller moves it)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(hf_config, dtype, cfg)
    moe = hf_config.model_type in MOE_FAMILIES
    spec = get_gpt_layer_local_spec(
        num_experts=hf_config.num_experts if moe else None, qk_layernorm=config.qk_layernorm
    )
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=WeightMap(hf_config, cfg).padded_vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,  # whole-vocabulary logits on every TP rank
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=int(theta),
    )


def load_hf_weights(model: torch.nn.Module, mapping: WeightMap, hf: dict[str, torch.Tensor]):
    """Copy this rank's shards of the HF state dict `hf` into `model`; every parameter must
    be covered."""
    from megatron.core import parallel_state as ps

    state = mapping.rank_state(
        hf,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )
    params = dict(model.named_parameters())
    missing = params.keys() - state.keys()
    if missing:
        raise ValueError(f"the HF weights do not cover Megatron parameters {sorted(missing)[:4]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])


class _CpuRngTracker:
    """Megatron's RNG tracker for a CPU: a fork is a fork of the CPU generator."""

    def fork(self, name: str = "") -> contextlib.AbstractContextManager:
        return torch.random.fork_rng(devices=[])

    def is_initialized(self) -> bool:
        return True

    def add(self, name: str, seed: int) -> None:
        pass


def _cpu_rope_embedding(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    # RotaryEmbedding.get_emb without its move of `inv_freq` to the current CUDA device
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


class _CpuMemoryBuffer:
    """Megatron's global attention-score buffer, on the CPU (its contents are never read:
    `baddbmm` takes it with beta 0)."""

    def get_tensor(self, shape: tuple, dtype: torch.dtype, name: str, **_: Any) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


def allow_cpu() -> None:
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random

    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
    random._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    RotaryEmbedding.get_emb = _cpu_rope_embedding
