"""Batch-invariant ops: each row's result depends on that row alone, never on how many rows
share the call, where the row sits among them, or how many keys lie beyond a query.

True on-policy mode (`trainer.true_on_policy`) runs the engine and the trainer through these
ops, so both compute bit-identical log-probs. What breaks invariance on the CPU, measured:

- an fp32 GEMM of 1 or 2 rows takes another kernel (a GEMV) than one of 16 or more rows, with
  another summation order: `linear` pads its rows up to `ROW_TILE`;
- a pointwise op's vectorised loop handles a tensor's tail (and each thread's share) with the
  scalar function, which for fp32 SiLU (and bf16 rsqrt) rounds differently from the vector
  one: `pointwise` feeds the op chunks of `POINTWISE_CHUNK` elements, a multiple of every
  vector width and below ATen's grain size, so every element takes the vector path;
- a softmax or weighted sum over a row of keys reduces in an order set by the row's length:
  `attention` reduces in fixed chunks of `KEY_CHUNK` keys (its value sum a GEMM of that fixed
  depth per chunk) and adds the chunks' sums left to right, so keys past a query (-inf
  scores, zero weights) add exact zeros;
- a reduction over a strided dimension sums in an order set by the other dimensions: every
  reduction here runs over a contiguous last dimension.

Reductions over a fixed-length last dimension (a norm's mean, a chunk's sum), GEMMs of 16+
rows of a fixed depth (whatever their column count) and `torch.log_softmax` per row were
measured invariant to the number of rows (tests/test_batch_invariant.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW_TILE = 16  # fewest rows a linear runs with (the GEMM kernel of 16+ rows is row-invariant)
POINTWISE_CHUNK = 16384  # elements a pointwise call sees: a multiple of 64, below ATen's grain
KEY_CHUNK = 16  # keys reduced together in attention's softmax and weighted sum


def linear(x_N_I: torch.Tensor, weight_O_I: torch.Tensor, bias_O: torch.Tensor | None = None):
    """`F.linear` over the last dimension, each row computed as in a call of 16+ rows."""
    rows_N_I = x_N_I.reshape(-1, x_N_I.shape[-1])
    n = rows_N_I.shape[0]
    if n >= ROW_TILE:
        return F.linear(x_N_I, weight_O_I, bias_O)
    rows_N_I = F.pad(rows_N_I, (0, 0, 0, ROW_TILE - n))
    out_N_O = F.linear(rows_N_I, weight_O_I, bias_O)[:n]
    return out_N_O.reshape(*x_N_I.shape[:-1], out_N_O.shape[-1])


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise `fn`, every element through its vectorised path."""
    flat = x.reshape(-1)
    n = flat.numel()
    step = POINTWISE_CHUNK if n > POINTWISE_CHUNK else 64
    pad = -(-n // step) * step - n
    flat = F.pad(flat, (0, pad)) if pad else flat
    if step != POINTWISE_CHUNK:  # one call below the grain size: no split, no concatenation
        return fn(flat)[:n].view(x.shape)
    out = torch.cat([fn(chunk) for chunk in flat.split(POINTWISE_CHUNK)])
    return out[:n].view(x.shape)


def rms_norm(x_N_E: torch.Tensor, weight_E: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama / Qwen RMSNorm: in fp32, rounded to the input's dtype, times the weight."""
    xf_N_E = x_N_E.float().contiguous()
    variance_N_1 = (xf_N_E * xf_N_E).mean(-1, keepdim=True)
    normed_N_E = xf_N_E * pointwise(torch.rsqrt, variance_N_1 + eps)
    return weight_E * normed_N_E.to(x_N_E.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, gate) * up


def rotary_tables(
    positions_B_T: torch.Tensor, inv_freq_D2: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, D] of HF's default rotary embedding at these positions."""
    freqs_B_T_D2 = positions_B_T[..., None].float() * inv_freq_D2.to(positions_B_T.device)
    emb_B_T_D = torch.cat([freqs_B_T_D2, freqs_B_T_D2], dim=-1)
    cos = pointwise(torch.cos, emb_B_T_D) * scaling
    sin = pointwise(torch.sin, emb_B_T_D) * scaling
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x_B_T_H_D: torch.Tensor, cos_B_T_D: torch.Tensor, sin_B_T_D: torch.Tensor):
    """HF's x · cos + rotate_half(x) · sin."""
    half = x_B_T_H_D.shape[-1] // 2
    rotated = torch.cat([-x_B_T_H_D[..., half:], x_B_T_H_D[..., :half]], dim=-1)
    return x_B_T_H_D * cos_B_T_D[:, :, None] + rotated * sin_B_T_D[:, :, None]


def chunked_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` (a multiple of KEY_CHUNK long): each chunk's sum, then the chunks' sums
    added left to right, so trailing chunks of zeros change nothing."""
    # contiguous: a product of permuted operands may be laid out with this dimension outer,
    # and a reduction over a strided dimension sums in an order set by the other dimensions
    parts = x.movedim(dim, -1).contiguous().unflatten(-1, (-1, KEY_CHUNK)).sum(-1)
    return _left_to_right(parts.movedim(-1, 0))


def _left_to_right(parts: torch.Tensor) -> torch.Tensor:
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def rows_matmul(a_X_M_K: torch.Tensor, b_X_K_N: torch.Tensor) -> torch.Tensor:
    """Batched `a @ b` with at least ROW_TILE rows a GEMM (the row-invariant kernel)."""
    M = a_X_M_K.shape[-2]
    if M >= ROW_TILE:
        return torch.matmul(a_X_M_K, b_X_K_N)
    return torch.matmul(F.pad(a_X_M_K, (0, 0, 0, ROW_TILE - M)), b_X_K_N)[..., :M, :]


def attention(
    q_B_T_H_D: torch.Tensor,
    k_B_S_G_D: torch.Tensor,
    v_B_S_G_D: torch.Tensor,
    q_positions_B_T: torch.Tensor,
    key_lens_B: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Causal attention [B, T, H, D]: the query at position p of row b sees that row's keys at
    positions 0..p (key s sits at position s; keys at or past `key_lens_B[b]` are unset).

    Scores are GEMMs over the head dimension (a fixed depth); the weighted sum of values is a
    GEMM per chunk of KEY_CHUNK keys (a fixed depth), the chunks then added left to right."""
    B, T, H, D = q_B_T_H_D.shape
    S, G = k_B_S_G_D.shape[1], k_B_S_G_D.shape[2]
    pad = -(-S // KEY_CHUNK) * KEY_CHUNK - S
    keys_S = torch.arange(S + pad, device=q_B_T_H_D.device)
    set_B_S = keys_S < key_lens_B[:, None]
    k_B_S_G_D = F.pad(k_B_S_G_D, (0, 0, 0, 0, 0, pad))
    v_B_S_G_D = F.pad(v_B_S_G_D, (0, 0, 0, 0, 0, pad))
    v_B_S_G_D = torch.where(set_B_S[:, :, None, None], v_B_S_G_D, 0.0)  # unset slots: any bits
    k_B_H_D_S = k_B_S_G_D.repeat_interleave(H // G, 2).permute(0, 2, 3, 1).contiguous()
    q_B_H_T_D = q_B_T_H_D.transpose(1, 2).contiguous()
    scores_B_H_T_S = rows_matmul(q_B_H_T_D, k_B_H_D_S) * scaling
    seen_B_T_S = keys_S <= q_positions_B_T[..., None]
    scores_B_H_T_S = scores_B_H_T_S.float().masked_fill(~seen_B_T_S[:, None], float("-inf"))
    top_B_H_T_1 = scores_B_H_T_S.amax(-1, keepdim=True)
    weights_B_H_T_S = pointwise(torch.exp, scores_B_H_T_S - top_B_H_T_1)
    probs_B_H_T_S = weights_B_H_T_S / chunked_sum(weights_B_H_T_S)[..., None]
    # [B, H, chunks, T, KEY_CHUNK] @ [B, H, chunks, KEY_CHUNK, D], summed over the chunks
    probs_B_H_C_T_K = probs_B_H_T_S.to(v_B_S_G_D.dtype).unflatten(-1, (-1, KEY_CHUNK))
    probs_B_H_C_T_K = probs_B_H_C_T_K.transpose(2, 3).contiguous()
    v_B_H_S_D = v_B_S_G_D.repeat_interleave(H // G, 2).transpose(1, 2)
    v_B_H_C_K_D = v_B_H_S_D.unflatten(2, (-1, KEY_CHUNK)).contiguous()
    out_B_H_C_T_D = rows_matmul(probs_B_H_C_T_K, v_B_H_C_K_D)
    return _left_to_right(out_B_H_C_T_D.movedim(2, 0)).transpose(1, 2)
