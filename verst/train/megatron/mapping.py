"""HF <-> Megatron-core weight names and shapes, per rank of a (TP, PP, EP) layout, in pure
torch: no process groups, so the mapping is testable on a CPU.

Megatron's local layer spec fuses q, k and v into `linear_qkv`, one block per query group
([q heads of the group, k, v]) so that a tensor-parallel rank's rows are whole groups; and gate
and up into `linear_fc1`, each rank holding [its gate rows, its up rows]. Experts are split
across EP ranks in contiguous runs (rank e holds experts e·E/ep ...), not TP-split (expert
tensor parallel is 1). The vocabulary is padded to a multiple of TP with zero rows. HF names
are those of the in-memory transformers model (what engines take): a layer's experts are one
stacked tensor, `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj`.

An `Entry` is one Megatron parameter (for experts: one per local expert, `name` holding `{}`
for the local index): its stage-local name, the stage that holds it, how TP splits it, and
the HF tensors it is made of. `entries()` lists the non-expert entries first, then the expert
ones, which is the order weight sync sends them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from verst.train.megatron.config import MOE_FAMILIES, MegatronConfig

Kind = Literal["replicated", "rows", "cols", "qkv", "fc1", "vocab", "experts"]


@dataclass(frozen=True)
class Entry:
    name: str  # Megatron name, stage-local layer numbering
    stage: int
    kind: Kind
    hf_names: tuple[str, ...]

    @property
    def is_expert(self) -> bool:
        return self.kind == "experts"


class WeightMap:
    """The mapping for one HF config and layout."""

    def __init__(self, hf_config: Any, layout: MegatronConfig) -> None:
        self.hf_config = hf_config
        self.tp = layout.tensor_parallel
        self.pp = layout.pipeline_parallel
        self.ep = layout.expert_parallel
        self.moe = hf_config.model_type in MOE_FAMILIES
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.vocab = hf_config.vocab_size
        self.padded_vocab = -(-self.vocab // self.tp) * self.tp
        self.heads = hf_config.num_attention_heads
        self.groups = hf_config.num_key_value_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // self.heads
        self.layers_per_stage = hf_config.num_hidden_layers // self.pp

    def entries(self) -> list[Entry]:
        dense: list[Entry] = [Entry("embedding.word_embeddings.weight", 0, "vocab",
                                    ("model.embed_tokens.weight",))]  # fmt: skip
        experts: list[Entry] = []
        for layer in range(self.hf_config.num_hidden_layers):
            dense += self._attention(layer)
            layer_dense, layer_experts = self._mlp(layer)
            dense += layer_dense
            experts += layer_experts
        last = self.pp - 1
        norm = ("model.norm.weight",)
        dense.append(Entry("decoder.final_layernorm.weight", last, "replicated", norm))
        if not self.tied:
            dense.append(Entry("output_layer.weight", last, "vocab", ("lm_head.weight",)))
        elif self.pp > 1:  # the last stage holds its own copy of the shared embedding
            embed = ("model.embed_tokens.weight",)
            dense.append(Entry("output_layer.weight", last, "vocab", embed))
        return dense + experts

    def _place(self, layer: int) -> tuple[int, str, str]:
        stage = layer // self.layers_per_stage
        local = layer % self.layers_per_stage
        return stage, f"decoder.layers.{local}.", f"model.layers.{layer}."

    def _attention(self, layer: int) -> list[Entry]:
        stage, m, h = self._place(layer)
        attn = h + "self_attn."
        out = [
            Entry(m + "input_layernorm.weight", stage, "replicated",
                  (h + "input_layernorm.weight",)),
            Entry(m + "self_attention.linear_qkv.weight", stage, "qkv",
                  tuple(f"{attn}{p}_proj.weight" for p in "qkv")),
            Entry(m + "self_attention.linear_proj.weight", stage, "cols",
                  (attn + "o_proj.weight",)),
            Entry(m + "pre_mlp_layernorm.weight", stage, "replicated",
                  (h + "post_attention_layernorm.weight",)),
        ]  # fmt: skip
        if getattr(self.hf_config, "attention_bias", False) or self.hf_config.model_type == "qwen2":
            qkv_bias = tuple(f"{attn}{p}_proj.bias" for p in "qkv")
            out.append(Entry(m + "self_attention.linear_qkv.bias", stage, "qkv", qkv_bias))
        if self.hf_config.model_type in ("qwen3", "qwen3_moe"):
            for ours, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                name = m + f"self_attention.{ours}.weight"
                out.append(Entry(name, stage, "replicated", (f"{attn}{theirs}.weight",)))
        return out

    def _mlp(self, layer: int) -> tuple[list[Entry], list[Entry]]:
        stage, m, h = self._place(layer)
        if not self.moe:
            fc1 = (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")
            return [
                Entry(m + "mlp.linear_fc1.weight", stage, "fc1", fc1),
                Entry(m + "mlp.linear_fc2.weight", stage, "cols", (h + "mlp.down_proj.weight",)),
            ], []
        router = Entry(m + "mlp.router.weight", stage, "replicated", (h + "mlp.gate.weight",))
        ours, theirs = m + "mlp.experts.local_experts.{}.", h + "mlp.experts."
        return [router], [
            Entry(ours + "linear_fc1.weight", stage, "experts", (theirs + "gate_up_proj",)),
            Entry(ours + "linear_fc2.weight", stage, "experts", (theirs + "down_proj",)),
        ]

    def local_experts(self, ep_rank: int) -> range:
        """The global indices of the experts EP rank `ep_rank` holds, in local order."""
        per_rank = self.hf_config.num_experts // self.ep
        return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    # --- HF -> Megatron -----------------------------------------------------------------------

    def full(self, entry: Entry, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The entry's whole Megatron tensor (TP ranks' shards concatenated) from HF tensors."""
        return torch.cat(self.split(entry, hf), dim=1 if entry.kind == "cols" else 0)

    def split(self, entry: Entry, hf: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The entry's shard on each TP rank, in rank order."""
        parts = [hf[name] for name in entry.hf_names]
        tp = self.tp
        if entry.kind in ("replicated", "experts"):  # experts: the stack, split by `rank_state`
            return [parts[0]] * tp
        if entry.kind == "rows":
            return list(parts[0].chunk(tp))
        if entry.kind == "cols":
            return list(parts[0].chunk(tp, dim=1))
        if entry.kind == "vocab":
            weight = parts[0]
            pad = weight.new_zeros(self.padded_vocab - self.vocab, *weight.shape[1:])
            return list(torch.cat([weight, pad]).chunk(tp))
        if entry.kind == "fc1":
            gate, up = (p.chunk(tp) for p in parts)
            return [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
        return list(self._qkv(*parts).chunk(tp))

    def _qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[q; k; v] rows regrouped as one [q heads, k, v] block per query group."""
        per_group = self.heads // self.groups
        tail = q.shape[1:]
        q = q.reshape(self.groups, per_group * self.head_dim, *tail)
        k = k.reshape(self.groups, self.head_dim, *tail)
        v = v.reshape(self.groups, self.head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)

    # --- Megatron -> HF -----------------------------------------------------------------------

    def merge(self, entry: Entry, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The HF tensors of an entry from its TP ranks' shards (in rank order)."""
        names = entry.hf_names
        if entry.kind == "replicated":
            return {names[0]: shards[0]}
        if entry.kind == "rows":
            return {names[0]: torch.cat(shards)}
        if entry.kind == "cols":
            return {names[0]: torch.cat(shards, dim=1)}
        if entry.kind == "vocab":
            return {names[0]: torch.cat(shards)[: self.vocab]}
        if entry.kind == "fc1":
            pairs = [shard.chunk(2) for shard in shards]
            return {
                names[0]: torch.cat([gate for gate, _ in pairs]),
                names[1]: torch.cat([up for _, up in pairs]),
            }
        return dict(zip(names, self._unqkv(torch.cat(shards)), strict=True))

    def _unqkv(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        per_group = self.heads // self.groups
        tail = fused.shape[1:]
        blocks = fused.reshape(self.groups, (per_group + 2) * self.head_dim, *tail)
        q, k, v = blocks.split([per_group * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return tuple(t.reshape(-1, *tail).contiguous() for t in (q, k, v))

    def rank_state(
        self, hf: Mapping[str, torch.Tensor], *, tp_rank: int, pp_rank: int, ep_rank: int
    ) -> dict[str, torch.Tensor]:
        """The Megatron state dict of one rank, from the whole HF state dict."""
        state = {}
        for entry in self.entries():
            if entry.stage != pp_rank:
                continue
            if entry.is_expert:
                stack = hf[entry.hf_names[0]]
                for local, expert in enumerate(self.local_experts(ep_rank)):
                    state[entry.name.format(local)] = stack[expert].clone()
            else:
                state[entry.name] = self.split(entry, hf)[tp_rank].clone()
        return state

    def merge_experts(
        self, entry: Entry, per_rank: list[list[torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """An expert entry's stacked HF tensor from each EP rank's local experts (rank order)."""
        return {entry.hf_names[0]: torch.stack([t for local in per_rank for t in local])}
