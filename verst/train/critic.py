"""The PPO critic: the policy's transformer body with a scalar value head.

It is called exactly like a causal LM (`cached_forward`), and its "logits" are values
[B, T, 1], so the trainer's shared-prompt forward serves the policy and the critic alike.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from verst.models.forward import cache_argument


class ValueModel(torch.nn.Module):
    def __init__(self, policy: PreTrainedModel) -> None:
        super().__init__()
        self.model = copy.deepcopy(policy.model)  # `model.layers` is what FSDP wraps per layer
        self.config = policy.config
        self.value_head = torch.nn.Linear(policy.config.hidden_size, 1)
        # a zero head starts every value at 0: the first GAE advantages are the returns
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: object = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **{cache_argument(self.model): cache},
        )
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        # a ModelOutput, which torch's pytree walks: FSDP2 finds the values there and hooks the
        # unsharding of the head's parameters before backward (in a SimpleNamespace it did not:
        # the backward of two sharded ranks read the freed head); a copy, not the linear's
        # view, which FSDP2 warns of at every step
        return CausalLMOutput(logits=self.value_head(hidden).to(torch.float32, copy=True))


def policy_body_weights(policy_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a policy state dict that the critic's body shares (`model.*`)."""
    return {k: v for k, v in policy_weights.items() if k.startswith("model.")}
