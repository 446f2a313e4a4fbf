"""Rollout routing replay (R3) in the trainer, and how often the trainer agrees with rollout.

The engine records the experts of every position of a sample (`Sample.routed_experts`, SGLang's
`[len(tokens) − 1, layers, top_k]`). `RoutingReplay` lays them out as the trainer's forward
feeds its tokens (`routed_calls`: the micro-batch's prompts, then its responses, the two
forward calls of `response_outputs`) and hooks every router of the policy:

- replaying, a router's expert ids become the recorded ones, and its gate weights are its own
  scores at those ids (`verst.models.moe.gate_weights`), so the loss still reaches the router;
  a position with nothing recorded (-1: padding) keeps the router's own choice;
- always, it counts the recorded choices the router would have made itself
  (`train/routing_agreement`: the share of recorded (token, layer, expert) choices in the
  trainer's own top-k of that token and layer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from verst.models.moe import (
    NOT_ROUTED,
    RoutingShape,
    check_routed_experts,
    gate_weights,
    hook_routers,
    routers,
    routing_shape,
)
from verst.train.batching import MicroBatch, TrainItem


def require_moe(model: torch.nn.Module) -> RoutingShape:
    """The routing shape of `model`; ValueError naming `loss.routing_replay` for a dense one."""
    shape = routing_shape(model)
    if shape is None:
        raise ValueError(
            f"loss.routing_replay replays the experts of a mixture-of-experts model, and "
            f"{type(model).__name__} has no MoE layers"
        )
    return shape


def item_routing(item: TrainItem, shape: RoutingShape) -> torch.Tensor:
    """The item's routed experts as [len(tokens) − 1, layers, top_k]; ValueError when it has
    none or they are not this model's record of its tokens."""
    if item.routed_experts is None:
        raise ValueError(
            "loss.routing_replay: a sample carries no routed_experts (the rollout did not "
            "record them: a custom generate / agent function must ask for them with "
            "return_routed_experts, and the engine must report them)"
        )
    return check_routed_experts(item.routed_experts, len(item.tokens), shape)


def routed_calls(
    items: list[TrainItem], micro: MicroBatch, shape: RoutingShape
) -> list[torch.Tensor]:
    """The recorded experts of each token `response_outputs` feeds, per forward call, as
    [N, layers, top_k] long (N = the call's rows × width, flattened as the routers see them):
    the left-padded prompts [K, L], then (responses longer than one token) the responses but
    their last token [B, T − 1]; -1 at padding."""
    K, L = micro.prompt_ids_K_L.shape
    B, T = micro.response_ids_B_T.shape
    prompts = torch.full((K, L, shape.layers, shape.top_k), NOT_ROUTED, dtype=torch.long)
    responses = torch.full((B, max(T - 1, 0), shape.layers, shape.top_k), NOT_ROUTED)
    filled: set[int] = set()
    for b, (item, k) in enumerate(zip(items, micro.prompt_index_B.tolist(), strict=True)):
        rows = item_routing(item, shape).long()
        prompt = len(item.tokens) - item.response_length
        if k not in filled:  # the group's samples share the prompt: its first one's record
            n = min(prompt, rows.shape[0])
            prompts[k, L - prompt : L - prompt + n] = rows[:n]
            filled.add(k)
        responses[b, : max(item.response_length - 1, 0)] = rows[prompt:]
    device = micro.prompt_ids_K_L.device
    calls = [prompts.flatten(0, 1).to(device)]
    if T > 1:
        calls.append(responses.flatten(0, 1).to(device))
    return calls


class RoutingReplay:
    """Forward hooks on the policy's routers that replay (or only compare against) the
    recorded experts of the forward calls they are given (`calls`)."""

    def __init__(self, model: torch.nn.Module, *, replay: bool) -> None:
        self.replay = replay
        self.first_layer = routers(model)[0][0]
        self.calls: list[torch.Tensor] = []
        self.call = -1
        self.count = True
        self.agreed = 0.0
        self.recorded = 0.0
        self._handles = hook_routers(model, self._hook)

    @contextlib.contextmanager
    def feeding(
        self, calls: list[torch.Tensor], *, replay: bool | None = None, count: bool = True
    ) -> Iterator[None]:
        """The forward calls inside read `calls` in order (`replay` overrides the mode; with
        `count` off, they are left out of the agreement)."""
        mode = self.replay
        self.calls, self.call, self.count = calls, -1, count
        self.replay = mode if replay is None else replay
        try:
            yield
        finally:
            self.calls, self.replay = [], mode

    def take_counts(self) -> dict[str, float]:
        """The recorded choices seen since the last call and those the routers made
        themselves (`routing_recorded`, `routing_agreed`); both 0 when none were seen."""
        counts = {"routing_agreed": self.agreed, "routing_recorded": self.recorded}
        self.agreed = self.recorded = 0.0
        return counts

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, layer: int, router: torch.nn.Module, output: tuple) -> tuple | None:
        if not self.calls:
            return None
        if layer == self.first_layer:
            self.call += 1
        logits_N_E, weights_N_K, own_N_K = output
        recorded_N_K = self.calls[self.call][:, layer]
        if recorded_N_K.shape != own_N_K.shape:
            raise ValueError(
                f"routed experts of shape {tuple(recorded_N_K.shape)} for a forward of "
                f"{tuple(own_N_K.shape)} routing choices in layer {layer}"
            )
        valid_N_K = recorded_N_K != NOT_ROUTED
        if self.count:
            with torch.no_grad():
                hit_N_K = (recorded_N_K[:, :, None] == own_N_K[:, None, :]).any(-1)
                self.agreed += float((hit_N_K & valid_N_K).sum())
                self.recorded += float(valid_N_K.sum())
        if not self.replay:
            return None
        ids_N_K = torch.where(valid_N_K.all(-1, keepdim=True), recorded_N_K, own_N_K)
        return logits_N_E, gate_weights(router, logits_N_E, ids_N_K), ids_N_K
