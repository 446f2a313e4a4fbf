"""The one forward both sides run in true on-policy mode: a Llama-family decoder through the
batch-invariant ops of `batch_invariant`, reading the HF model's own parameters at call time.

The engine calls it with the K/V of earlier tokens in its paged pool, one token a row (decode)
or a chunk (prefill); the trainer calls it on whole sequences. Every op's result for a token
depends on that token's row alone, and attention reduces over the keys in fixed chunks, so a
token's logits are bitwise the same either way. `covers` says which models it reads; any
other model in true on-policy mode is refused at config or build time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verst.models import batch_invariant as bi
from verst.models import invariant_cuda

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
TRUE_ON_POLICY_FAMILIES = ("qwen3", "qwen2", "llama", "qwen3-moe")  # the tiny families it reads

# (layer, new K [B, T, G, D], new V) -> every key of each row, K and V [B, G, W, D] as
# `batch_invariant.attention` takes them
KeySource = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def covers(model: torch.nn.Module, device: torch.device | None = None) -> str | None:
    """None when `InvariantDecoder` reads `model` on `device` (default: where its weights
    are); else why not (for the error message)."""
    device = device or next(model.parameters()).device
    if device.type == "cuda" and not invariant_cuda.available():
        return "a CUDA device without Triton (its invariant GEMM is a Triton kernel)"
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} (true on-policy covers {', '.join(MODEL_TYPES)})"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r} (needs silu)"
    rope = _rope(config)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope_scaling {rope} (needs the default rotary embedding)"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        if window < config.max_position_embeddings:
            return f"sliding_window {window} (below max_position_embeddings)"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or getattr(config, "final_logit_softcapping", None):
        return "an output head other than a plain linear layer"
    for layer in model.get_decoder().layers:
        projections = [layer.self_attn.q_proj, layer.self_attn.o_proj]
        projections += [] if _is_moe(layer.mlp) else [layer.mlp.down_proj]
        if any(type(m) is not torch.nn.Linear for m in projections):
            return "projections other than plain nn.Linear (LoRA layers?)"
    return None


class InvariantDecoder:
    def __init__(self, model: torch.nn.Module) -> None:
        reason = covers(model)
        if reason is not None:
            raise ValueError(f"true on-policy mode cannot run {reason}")
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = model.get_decoder().layers[0].self_attn.head_dim
        # from the config, in fp32: the model's `inv_freq` buffer is cast with the model (a
        # bf16 engine copy holds a rounded one, the fp32 trainer an exact one)
        theta = _rope(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.inv_freq_D2 = 1.0 / (theta**steps)

    def hidden(
        self,
        ids_B_T: torch.Tensor,
        positions_B_T: torch.Tensor,
        keys: KeySource,
    ) -> torch.Tensor:
        """The final-norm hidden states [B, T, E] of the fed tokens."""
        decoder = self.model.get_decoder()
        x_B_T_E = decoder.embed_tokens(ids_B_T)
        inv_freq_D2 = self._inv_freq(positions_B_T.device)
        scaling = decoder.rotary_emb.attention_scaling
        cos, sin = bi.rotary_tables(positions_B_T, inv_freq_D2, scaling, x_B_T_E.dtype)
        masks: dict[int, torch.Tensor] = {}  # attention's, per key width: alike in every layer

        def unseen(W: int) -> torch.Tensor:
            if W not in masks:
                masks[W] = bi.unseen_keys(positions_B_T, self.heads // self.kv_heads, W)
            return masks[W]

        for index, layer in enumerate(decoder.layers):
            h_B_T_E = _norm(layer.input_layernorm, x_B_T_E)
            attn = self._attention(index, layer.self_attn, h_B_T_E, (cos, sin), unseen, keys)
            x_B_T_E = x_B_T_E + attn
            h_B_T_E = _norm(layer.post_attention_layernorm, x_B_T_E)
            x_B_T_E = x_B_T_E + (
                _moe(layer.mlp, h_B_T_E) if _is_moe(layer.mlp) else _mlp(layer.mlp, h_B_T_E)
            )
        return _norm(decoder.norm, x_B_T_E)

    def logits(self, hidden_N_E: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] of hidden states."""
        return _linear(self.model.get_output_embeddings(), hidden_N_E).float()

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """The rotary frequencies on `device`, copied there once (a CUDA graph's capture
        cannot copy from the host)."""
        if self.inv_freq_D2.device != device:
            self.inv_freq_D2 = self.inv_freq_D2.to(device)
        return self.inv_freq_D2

    def _attention(
        self,
        index: int,
        attn: torch.nn.Module,
        h_B_T_E: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        unseen: Callable[[int], torch.Tensor],
        keys: KeySource,
    ) -> torch.Tensor:
        B, T, _ = h_B_T_E.shape
        if h_B_T_E.is_cuda:
            q, k, v = self._qkv_apart(attn, h_B_T_E, rotary)
        else:
            q, k, v = self._qkv_together(attn, h_B_T_E, rotary)
        k_B_G_W_D, v_B_G_W_D = keys(index, k, v)
        unseen_B_1_M_W = unseen(k_B_G_W_D.shape[2])
        out = bi.attention(q, k_B_G_W_D, v_B_G_W_D, unseen_B_1_M_W, attn.scaling)
        return _linear(attn.o_proj, out.reshape(B, T, -1))

    def _qkv_apart(
        self, attn: torch.nn.Module, h_B_T_E: torch.Tensor, rotary: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (normed, rotated) and V [B, T, heads, D], a GEMM and a norm each."""
        (B, T, _), D = h_B_T_E.shape, self.head_dim
        q = _linear(attn.q_proj, h_B_T_E).view(B, T, self.heads, D)
        k = _linear(attn.k_proj, h_B_T_E).view(B, T, self.kv_heads, D)
        v = _linear(attn.v_proj, h_B_T_E).view(B, T, self.kv_heads, D)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3's per-head norms
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        return bi.apply_rotary(q, *rotary), bi.apply_rotary(k, *rotary), v

    def _qkv_together(
        self, attn: torch.nn.Module, h_B_T_E: torch.Tensor, rotary: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_qkv_apart`'s results from one GEMM of the three weights, Q and K then normed and
        rotated as one tensor: a row's bits do not depend on its neighbours in either (the
        CPU's GEMM of 16+ rows, a norm over each head's contiguous D)."""
        (B, T, _), D, H, G = h_B_T_E.shape, self.head_dim, self.heads, self.kv_heads
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        weight_O_E = torch.cat([m.weight for m in projections])
        biases = [m.bias for m in projections]
        bias_O = None if biases[0] is None else torch.cat(biases)
        qkv = bi.linear(h_B_T_E, weight_O_E, bias_O)
        qk_B_T_F_D = qkv[..., : (H + G) * D].view(B, T, H + G, D)
        v = qkv[..., (H + G) * D :].view(B, T, G, D)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3's per-head norms (one eps)
            q_norm, k_norm = attn.q_norm.weight, attn.k_norm.weight
            weight_F_D = torch.cat([q_norm.expand(H, D), k_norm.expand(G, D)])
            qk_B_T_F_D = bi.rms_norm(qk_B_T_F_D, weight_F_D, attn.q_norm.variance_epsilon)
        qk_B_T_F_D = bi.apply_rotary(qk_B_T_F_D, *rotary)
        return qk_B_T_F_D[:, :, :H], qk_B_T_F_D[:, :, H:], v


def own_keys(layer: int, k_B_T_G_D: torch.Tensor, v_B_T_G_D: torch.Tensor):
    """Keys of whole sequences fed at once (the trainer): each row's own new K/V."""
    return bi.heads_first(k_B_T_G_D), bi.heads_first(v_B_T_G_D)


def _is_moe(mlp: torch.nn.Module) -> bool:
    return hasattr(mlp, "experts")


def _mlp(mlp: torch.nn.Module, h_B_T_E: torch.Tensor) -> torch.Tensor:
    act = bi.silu_mul(_linear(mlp.gate_proj, h_B_T_E), _linear(mlp.up_proj, h_B_T_E))
    return _linear(mlp.down_proj, act)


def _moe(block: torch.nn.Module, h_B_T_E: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's sparse block: its router's softmax top-k (renormalised), each expert run on
    the tokens that chose it and the experts' outputs added in expert order. A token's rows
    come out of `bi.linear` alike whichever tokens share its expert's GEMM, and the terms left
    out are the exact zeros of the experts it did not choose, so its bits do not depend on the
    others. On CUDA every expert runs on every token, the unchosen ones with weight exactly 0:
    a CUDA graph's capture cannot size an expert's rows."""
    router, experts = block.gate, block.experts
    x_N_E = h_B_T_E.reshape(-1, h_B_T_E.shape[-1])
    logits_N_X = bi.linear(x_N_E, router.weight).float()
    weights_N_X = bi.pointwise(torch.exp, logits_N_X - logits_N_X.amax(-1, keepdim=True))
    probs_N_X = weights_N_X / bi.row_sum(weights_N_X)[:, None]
    top_N_K, ids_N_K = probs_N_X.topk(router.top_k, dim=-1)
    if router.norm_topk_prob:
        top_N_K = top_N_K / bi.row_sum(top_N_K)[:, None]
    gates_N_X = torch.zeros_like(probs_N_X).scatter(1, ids_N_K, top_N_K).to(x_N_E.dtype)
    out_N_E = torch.zeros_like(x_N_E)
    for e in range(gates_N_X.shape[1]):
        if x_N_E.is_cuda:
            out_N_E = out_N_E + gates_N_X[:, e, None] * _expert(experts, e, x_N_E)
            continue
        rows_R = (ids_N_K == e).any(-1).nonzero()[:, 0]
        if len(rows_R):
            y_R_E = _expert(experts, e, x_N_E.index_select(0, rows_R))
            out_N_E = out_N_E.index_add(0, rows_R, gates_N_X[rows_R, e, None] * y_R_E)
    return out_N_E.view(h_B_T_E.shape)


def _expert(experts: torch.nn.Module, e: int, x_R_E: torch.Tensor) -> torch.Tensor:
    gate, up = bi.linear(x_R_E, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return bi.linear(bi.silu_mul(gate, up), experts.down_proj[e])


def _rope(config: object) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return bi.linear(x, module.weight, module.bias)


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return bi.rms_norm(x, module.weight, module.variance_epsilon)
