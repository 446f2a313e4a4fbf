"""Mixture-of-experts layers as the engine and the trainer see them: where the routers are, the
shape of a routing record, batched expert dispatch, and the gate weights of given experts.

Every MoE family transformers ships that verst builds (Qwen3-MoE, Mixtral, DeepSeek-V3,
gpt-oss) has a router module that returns `(router_logits [N, E], gate_weights [N, k],
expert_ids [N, k])` for the N tokens of a forward, flattened batch-major, and an experts module
that takes the ids and weights. Capture (the engine) and replay (the trainer, R3) are forward
hooks on those routers, so both sides read and steer routing the same way.

A routing record is SGLang's `routed_experts`: int32 `[tokens, num_hidden_layers, top_k]`;
layers without experts (DeepSeek-V3's first dense layers) hold -1.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass

import torch

# router class name -> how it turns router logits [N, E] into gate weights at ids [N, k]
_GATES: dict[str, str] = {
    "Qwen3MoeTopKRouter": "softmax",
    "MixtralTopKRouter": "softmax",
    "DeepseekV3TopkRouter": "sigmoid",
    "GptOssTopKRouter": "softmax_of_top",
}
NOT_ROUTED = -1  # a record's entry for a layer without experts (or a token no forward routed)


@dataclass(frozen=True)
class RoutingShape:
    """The routing record of a model: `layers` (all hidden layers) and `top_k` per token."""

    layers: int
    top_k: int


def routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router module) of each MoE layer of `model`, in layer order."""
    found = []
    for index, layer in enumerate(model.get_decoder().layers):
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
        if gate is not None and type(gate).__name__ in _GATES:
            found.append((index, gate))
    return found


def routing_shape(model: torch.nn.Module) -> RoutingShape | None:
    """The routing record's shape of `model`, or None for a dense model."""
    found = routers(model)
    if not found:
        return None
    return RoutingShape(len(model.get_decoder().layers), int(found[0][1].top_k))


def use_grouped_experts(model: torch.nn.Module) -> None:
    """Run `model`'s experts as one grouped GEMM over tokens sorted by expert (transformers'
    `grouped_mm`: `torch.nn.functional.grouped_mm` where the device and dtype have it, else
    one matmul per expert on its contiguous rows), not a loop over experts with masks."""
    if routing_shape(model) is not None:
        model.set_experts_implementation("grouped_mm")


def gate_weights(router: torch.nn.Module, logits_N_E: torch.Tensor, ids_N_K: torch.Tensor):
    """The gate weights [N, k] `router` gives experts `ids_N_K` from its own `logits_N_E`,
    computed as its forward computes them for the experts it picks (so gradients reach the
    router through the weights of replayed experts)."""
    kind = _GATES[type(router).__name__]
    if kind == "softmax_of_top":  # gpt-oss: softmax over the chosen experts' logits
        top = logits_N_E.gather(1, ids_N_K)
        return torch.softmax(top, dim=1, dtype=top.dtype)
    if kind == "sigmoid":  # DeepSeek-V3: sigmoid scores, normalised, scaled
        weights = logits_N_E.sigmoid().gather(1, ids_N_K)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    weights = torch.softmax(logits_N_E, dtype=torch.float, dim=-1).gather(1, ids_N_K)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always normalises
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # Qwen3-MoE returns its weights in the logits' dtype, Mixtral keeps fp32
    return weights.to(logits_N_E.dtype) if type(router).__name__.startswith("Qwen") else weights


RouterHook = Callable[[int, torch.nn.Module, tuple], tuple | None]


def hook_routers(model: torch.nn.Module, hook: RouterHook) -> list:
    """Register `hook(layer, router, output)` as a forward hook on every router of `model`
    (its return value, when not None, replaces the router's output); returns the handles."""
    handles = []
    for layer, router in routers(model):

        def forward_hook(module, args, output, layer=layer):
            return hook(layer, module, output)

        handles.append(router.register_forward_hook(forward_hook))
    return handles


def encode_routed_experts(routed: torch.Tensor) -> str:
    """SGLang's `meta_info.routed_experts`: the int32 array's bytes, base64."""
    return base64.b64encode(routed.to(torch.int32).contiguous().numpy().tobytes()).decode()


def decode_routed_experts(text: str, rows: int) -> torch.Tensor:
    """SGLang's base64 `routed_experts` of `rows` positions as int32 [rows, layers × top_k]
    (the body does not say how the columns split; `check_routed_experts` does)."""
    flat = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.int32)
    if rows <= 0 or flat.numel() % rows:
        raise ValueError(
            f"routed_experts: {flat.numel()} int32 values do not split into {rows} positions "
            "(prompt + completion tokens − 1)"
        )
    return flat.view(rows, -1)


def check_routed_experts(routed: torch.Tensor, tokens: int, shape: RoutingShape) -> torch.Tensor:
    """`routed` ([tokens − 1, layers, top_k], or its rows flattened) as int32 [tokens − 1,
    layers, top_k]; ValueError naming both shapes when it is not the model's record of
    `tokens` tokens."""
    want = (tokens - 1, shape.layers, shape.top_k)
    if routed.numel() != want[0] * want[1] * want[2] or routed.shape[0] != want[0]:
        raise ValueError(
            f"routed_experts has shape {tuple(routed.shape)}, expected {want} (tokens − 1, "
            "layers, top_k) for this sample and model"
        )
    return routed.reshape(want).to(torch.int32)
