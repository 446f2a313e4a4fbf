"""Attention that reads and writes the paged KV pool in place, inside the model's own code.

Owns the `verst_paged` attention function, registered in transformers' `AttentionInterface`,
and `PagedStep`, the per-step description of where each new token's K/V goes and which pages
each row attends over. While the engine runs a forward (`paged_attention_mode`), every HF
attention layer of the model (Qwen2, Qwen3, Llama, ... : anything that dispatches through
`ALL_ATTENTION_FUNCTIONS` and keeps `module.layer_idx`) calls `paged_attention` with the new
tokens' queries, keys and values after RoPE; it

1. writes the new K/V into their pool slots (`index_copy_`, one op per layer for K and V);
2. attends over the row's pages:
   - decode steps on CUDA (one token a row): a Triton kernel that walks each row's page table
     (no copy of the cache, any length, a fixed launch shape, so CUDA graphs can capture it);
   - decode steps on the CPU: a C kernel that does the same (`cpu_kernels`), where it builds;
   - a step whose rows all start at position 0 (fresh prompts): causal SDPA over the new
     tokens alone;
   - otherwise (later prefill chunks, mixed steps, the CPU): a gather of the rows' pages and
     SDPA with a mask built once per step for all layers;
   - a layer whose sliding window some row of the step outgrew, or with attention sinks
     (gpt-oss) or a logit soft-cap (Gemma-2), or K/V heads of different widths (MLA, which no
     kernel reads): the gather, with a windowed mask, and HF's eager math for sinks and caps.

No `DynamicCache` is built and no attention mask goes through HF's mask code (a custom
attention implementation makes HF skip it), so per-step work does not grow with the cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from verst.engine.kv_pool import KVPool

ATTENTION_NAME = "verst_paged"

try:  # Triton is only used on CUDA; the CPU path needs none of it
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


@dataclass
class PagedStep:
    """Where one forward's new tokens go and what each row attends over.

    Rows are padded to T tokens: `slots_N` (N = B*T) is each token's flat pool slot
    (page * page_size + offset; padding tokens write the pool's scratch slot).
    `decode`: every row feeds one token and attends over `seq_lens_B` tokens through
    `table_B_P`, read in place by `decode_kernel` when there is one (Triton on CUDA, C on the
    CPU; without one, decode steps gather like any other). Otherwise `table_B_P` lists the
    pages to gather (padded with page 0) and each query sees the gathered positions up to its
    own (`past_B`: each row's tokens in the pool before the step), the mask built once a step
    per window (`mask`). A `fresh` step (every row starts at position 0) needs neither: it
    attends over its new tokens alone.
    `windowed`: some row is longer than the model's shortest sliding window, so the layers with
    a window attend through the gather with a windowed mask (the in-place kernels and the
    fresh path see every position); the runner decides it on the host, from the rows' lengths.
    """

    pool: KVPool
    slots_N: torch.Tensor
    table_B_P: torch.Tensor
    past_B: torch.Tensor
    decode: bool = False
    seq_lens_B: torch.Tensor | None = None
    fresh: bool = False  # no row has KV in the pool yet: attend over the new tokens alone
    windowed: bool = False
    # (q [B, Hq, D], k pages, v pages, table, seq_lens, scale) -> [B, Hq, D]
    decode_kernel: Callable[..., torch.Tensor] | None = None
    _masks: dict[tuple[int, int, int | None], torch.Tensor] = field(default_factory=dict)

    def mask(self, group: int, T: int, window: int | None) -> torch.Tensor:
        """[B, 1, group*T, S] bool over the gathered positions, made once a step per window."""
        key = (group, T, window)
        if key not in self._masks:
            width = self.table_B_P.shape[1]
            self._masks[key] = step_mask(
                self.past_B, T, width, group, self.pool.page_size, window=window
            )
        return self._masks[key]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention interface: query [B, Hq, T, D], key / value [B, Hkv, T, D] ->
    ([B, T, Hq, D], None). Honours the layer's `sliding_window`, gpt-oss's attention sinks
    (`s_aux`) and Gemma-2's logit `softcap`, as HF's eager attention does."""
    step: PagedStep | None = kwargs.get("verst_paged")
    if step is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} runs only inside the engine's forward "
            "(it needs the step's page tables)"
        )
    out_B_T_H_D = attend(
        step,
        module.layer_idx,
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        query.shape[-1] ** -0.5 if scaling is None else scaling,
        window=kwargs.get("sliding_window"),
        sinks_H=kwargs.get("s_aux"),
        softcap=kwargs.get("softcap"),
    )
    return out_B_T_H_D, None


def attend(
    step: PagedStep,
    layer: int,
    q_B_T_H_D: torch.Tensor,
    k_B_T_H_D: torch.Tensor | None,
    v_B_T_H_D: torch.Tensor | None,
    scaling: float,
    *,
    window: int | None = None,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write one layer's new K/V into the pool and attend over each row's pages: [B, T, Hq, Dv].

    `window`: a query at position p sees keys at positions > p - window (HF's sliding window);
    `sinks_H`: one logit per query head that joins every softmax and takes no value;
    `softcap`: scores become tanh(score / softcap) * softcap before the mask.
    K and V None: a kernel already wrote them into the pool (`CudaKernels.rope_store`)."""
    B, T, Hq, D = q_B_T_H_D.shape
    pool = step.pool
    Hkv, Dv = pool.k[layer].shape[2], pool.v[layer].shape[3]
    if k_B_T_H_D is not None and v_B_T_H_D is not None:
        k_flat, v_flat = pool.flat(layer)
        k_flat.index_copy_(0, step.slots_N, k_B_T_H_D.reshape(B * T, Hkv, D).to(pool.dtype))
        v_flat.index_copy_(0, step.slots_N, v_B_T_H_D.reshape(B * T, Hkv, Dv).to(pool.dtype))
    elif step.fresh:
        raise ValueError("a fresh step attends over its new K/V tensors: pass them")
    window = window if step.windowed else None  # no row is longer than it: nothing to hide
    plain = window is None and sinks_H is None and softcap is None
    if plain and step.decode and step.decode_kernel is not None:
        # one query token a row, read against its pages in place
        out_B_H_D = step.decode_kernel(
            q_B_T_H_D.reshape(B, Hq, D),
            pool.k[layer],
            pool.v[layer],
            step.table_B_P,
            step.seq_lens_B,
            scaling,
        )
        return out_B_H_D.view(B, 1, Hq, D).to(q_B_T_H_D.dtype)
    if plain and step.fresh:
        # no row has KV in the pool before this step: causal attention over the new tokens
        # alone (flash / memory-efficient kernels, no gather, no mask); rows are right-padded,
        # so a real query never sees a padding key
        out_B_H_T_D = F.scaled_dot_product_attention(
            q_B_T_H_D.transpose(1, 2).to(pool.dtype),
            k_B_T_H_D.transpose(1, 2).to(pool.dtype),
            v_B_T_H_D.transpose(1, 2).to(pool.dtype),
            is_causal=True,
            scale=scaling,
            enable_gqa=Hq != Hkv,
        )
        return out_B_H_T_D.transpose(1, 2).to(q_B_T_H_D.dtype)
    group = Hq // Hkv
    P = step.table_B_P.shape[1]
    S = P * pool.page_size
    # index_select over whole pages: a memcpy per page (advanced indexing is ~4x slower on CPU)
    pages_N = step.table_B_P.reshape(-1)
    k_B_H_S_D = pool.k[layer].view(pool.num_pages, -1).index_select(0, pages_N)
    v_B_H_S_D = pool.v[layer].view(pool.num_pages, -1).index_select(0, pages_N)
    k_B_H_S_D = k_B_H_S_D.view(B, S, Hkv, D).transpose(1, 2)
    v_B_H_S_D = v_B_H_S_D.view(B, S, Hkv, Dv).transpose(1, 2)
    # grouped-query attention without repeating K/V: the query heads that share a KV head
    # become extra query rows of it
    q_B_H_Q_D = q_B_T_H_D.transpose(1, 2).reshape(B, Hkv, group * T, D).to(pool.dtype)
    mask_B_1_Q_S = step.mask(group, T, window)
    if sinks_H is None and softcap is None:
        out = F.scaled_dot_product_attention(
            q_B_H_Q_D, k_B_H_S_D, v_B_H_S_D, attn_mask=mask_B_1_Q_S, scale=scaling
        )
    else:
        out = _eager(q_B_H_Q_D, k_B_H_S_D, v_B_H_S_D, mask_B_1_Q_S, scaling, sinks_H, softcap)
    out_B_T_H_D = out.view(B, Hkv, group, T, Dv).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, Dv)
    return out_B_T_H_D.to(q_B_T_H_D.dtype)


def _eager(
    q_B_H_Q_D: torch.Tensor,
    k_B_H_S_D: torch.Tensor,
    v_B_H_S_D: torch.Tensor,
    mask_B_1_Q_S: torch.Tensor,
    scaling: float,
    sinks_H: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention as HF's eager code computes it, for what SDPA has no argument for: soft-capped
    scores and sink logits. The query rows of a KV head are (group of heads) x T."""
    scores_B_H_Q_S = torch.matmul(q_B_H_Q_D, k_B_H_S_D.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores_B_H_Q_S = torch.tanh(scores_B_H_Q_S / softcap) * softcap
    scores_B_H_Q_S = scores_B_H_Q_S.masked_fill(~mask_B_1_Q_S, float("-inf"))
    if sinks_H is not None:
        B, Hkv, Q, _ = scores_B_H_Q_S.shape
        group = sinks_H.shape[0] // Hkv
        sinks_1_H_Q_1 = sinks_H.to(scores_B_H_Q_S.dtype).view(1, Hkv, group, 1, 1)
        sinks_B_H_Q_1 = sinks_1_H_Q_1.expand(B, Hkv, group, Q // group, 1).reshape(B, Hkv, Q, 1)
        scores_B_H_Q_S = torch.cat([scores_B_H_Q_S, sinks_B_H_Q_1], dim=-1)
    # HF subtracts the row max first (gpt-oss does it explicitly); softmax does the same
    probs = torch.softmax(scores_B_H_Q_S, dim=-1)
    if sinks_H is not None:
        probs = probs[..., :-1]  # the sink's share of the mass goes nowhere
    return torch.matmul(probs.to(v_B_H_S_D.dtype), v_B_H_S_D)


def model_window(config: Any) -> int | None:
    """The shortest sliding window any layer of the model an HF config describes attends
    with, or None when no layer slides (a `layer_types` list names the sliding ones; without
    one, Mistral's `sliding_window` applies to every layer)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


transformers.AttentionInterface.register(ATTENTION_NAME, paged_attention)


@contextlib.contextmanager
def paged_attention_mode(model: torch.nn.Module) -> Iterator[None]:
    """Route the model's attention through `paged_attention` for the duration (the model is
    left as it was: a trainer or HF `generate` sharing it keeps its own implementation)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = before


def decode_mask(seq_lens_B: torch.Tensor, width: int, group: int, page_size: int) -> torch.Tensor:
    """[B, 1, group, width*page_size] bool: position s is visible iff s < seq_len."""
    positions_S = torch.arange(width * page_size, device=seq_lens_B.device)
    visible_B_S = positions_S < seq_lens_B[:, None]
    return visible_B_S[:, None, None, :].expand(-1, 1, group, -1)


def step_mask(
    past_B: torch.Tensor,
    T: int,
    width: int,
    group: int,
    page_size: int,
    window: int | None = None,
) -> torch.Tensor:
    """[B, 1, group*T, width*page_size] bool: query t of a row with `past` cached tokens sees
    positions s <= past + t (its own K/V is written before the gather), and with a `window`
    only those with s > past + t - window."""
    positions_S = torch.arange(width * page_size, device=past_B.device)
    last_B_T = past_B[:, None] + torch.arange(T, device=past_B.device)
    visible_B_T_S = positions_S[None, None, :] <= last_B_T[:, :, None]
    if window is not None:
        visible_B_T_S &= positions_S[None, None, :] > last_B_T[:, :, None] - window
    B = past_B.shape[0]
    return visible_B_T_S[:, None, None].expand(B, 1, group, T, -1).reshape(B, 1, group * T, -1)


def paged_decode_reference(
    q_B_H_D: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table_B_P: torch.Tensor,
    seq_lens_B: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """What `paged_decode_triton` computes, in plain PyTorch (tests compare the two)."""
    B, Hq, D = q_B_H_D.shape
    _, page, Hkv, _ = k_pages.shape
    P = table_B_P.shape[1]
    k = k_pages[table_B_P].view(B, P * page, Hkv, D).transpose(1, 2).float()
    v = v_pages[table_B_P].view(B, P * page, Hkv, D).transpose(1, 2).float()
    q = q_B_H_D.float().view(B, Hkv, Hq // Hkv, D)
    mask = decode_mask(seq_lens_B, P, Hq // Hkv, page)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, D).to(q_B_H_D.dtype)
