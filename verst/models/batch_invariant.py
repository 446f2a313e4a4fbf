"""Batch-invariant ops: each row's result depends on that row alone, never on how many rows
share the call, where the row sits among them, or how many keys lie beyond a query.

True on-policy mode (`trainer.true_on_policy`) runs the engine and the trainer through these
ops, so both compute bit-identical log-probs. What breaks invariance on the CPU, measured:

- an fp32 GEMM of 1 or 2 rows takes another kernel (a GEMV) than one of 16 or more rows, with
  another summation order: `linear` pads its rows up to `ROW_TILE`;
- a pointwise op's vectorised loop handles a tensor's tail (and each thread's share) with the
  scalar function, which for fp32 SiLU (and bf16 rsqrt) rounds differently from the vector
  one: `pointwise` feeds the op calls of at most `POINTWISE_CHUNK` elements (below ATen's
  grain size), each a multiple of 64 (of every vector width), so every element takes the
  vector path. fp32 rsqrt needs none of it (both paths round 1 / sqrt(x) correctly): the
  norms, which take it in fp32, call it as is;
- a softmax or weighted sum over a row of keys reduces in an order set by the row's length:
  `attention` reduces in fixed chunks of `KEY_CHUNK` keys (its value sum a GEMM of that fixed
  depth per chunk) and adds the chunks' sums left to right, so keys past a query (-inf
  scores, zero weights) add exact zeros, and chunks past every query can be left out;
- a reduction over a strided dimension sums in an order set by the other dimensions: every
  reduction here runs over a contiguous last dimension.

Reductions over a fixed-length last dimension (a norm's mean, a chunk's sum), GEMMs of 16+
rows of a fixed depth (whatever their 16+ columns, batch count or operand strides) and
`torch.log_softmax` per row were measured invariant to the number of rows
(tests/test_batch_invariant.py). So were GEMMs of 4, 8 or 12 rows, fp32 and bf16, batched
or one matrix, on 1 and 2 threads; 1 to 3 rows never matched, and 5 to 7 or 9 to 11 rows not
with one matrix on 2 threads (MKL splits its rows between the threads, and a share of fewer
than 4 rows takes another kernel): attention pads fewer than 12 rows up to a multiple of 4
(`ATTENTION_ROWS`; a decode step has H / G rows, often 4 or fewer).
A GEMM's column count matters below 16 in fp32, so attention's rows are queries, not keys.

On CUDA, cuBLAS's GEMMs and PyTorch's reductions pick their kernels (and summation orders)
from the shapes, so every GEMM and every sum over a last dimension runs through
`invariant_cuda`'s fixed-tile Triton kernel instead; its order over a depth ignores trailing
zeros, so attention needs no chunking there. CUDA's elementwise kernels compute each element
alike wherever it sits, so `pointwise` calls them once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from verst.models import invariant_cuda

ROW_TILE = 16  # fewest rows a linear runs with (the GEMM kernel of 16+ rows is row-invariant)
ATTENTION_ROWS = (4, 8, 12)  # row counts attention's GEMMs round fewer rows up to
# elements a pointwise call sees: the largest multiple of 64 below ATen's grain size (32768),
# under which an elementwise op runs on one thread, in one vectorised loop
POINTWISE_CHUNK = 32704
KEY_CHUNK = 16  # keys reduced together in attention's softmax and weighted sum


def linear(x_N_I: torch.Tensor, weight_O_I: torch.Tensor, bias_O: torch.Tensor | None = None):
    """`F.linear` over the last dimension, each row computed as in a call of 16+ rows."""
    if x_N_I.is_cuda:
        out_N_O = invariant_cuda.matmul(x_N_I.reshape(-1, x_N_I.shape[-1]), weight_O_I.t())
        out_N_O = out_N_O if bias_O is None else out_N_O + bias_O
        return out_N_O.reshape(*x_N_I.shape[:-1], out_N_O.shape[-1])
    n = x_N_I.numel() // x_N_I.shape[-1]
    if n >= ROW_TILE:
        return F.linear(x_N_I, weight_O_I, bias_O)
    rows_N_I = F.pad(x_N_I.reshape(n, -1), (0, 0, 0, ROW_TILE - n))
    out_N_O = F.linear(rows_N_I, weight_O_I, bias_O)[:n]
    return out_N_O.reshape(*x_N_I.shape[:-1], out_N_O.shape[-1])


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise `fn`, every element through its vectorised path: calls of at
    most POINTWISE_CHUNK elements, each a multiple of 64 (only the last call is shorter)."""
    if x.is_cuda:
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % 64
    flat = F.pad(flat, (0, pad)) if pad else flat
    if n <= POINTWISE_CHUNK:  # one call below the grain size: no split, no concatenation
        out = fn(flat)
    else:
        out = torch.cat([fn(chunk) for chunk in flat.split(POINTWISE_CHUNK)])
    return (out[:n] if pad else out).view(x.shape)


def rms_norm(x_N_E: torch.Tensor, weight_E: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama / Qwen RMSNorm: in fp32, rounded to the input's dtype, times the weight."""
    if x_N_E.is_cuda:
        xf_N_E = x_N_E.float().contiguous()
        variance_N_1 = row_mean(xf_N_E * xf_N_E)[..., None]
    else:  # x · x comes out contiguous whatever x's strides: its mean needs no copy of x
        xf_N_E = x_N_E.float()
        variance_N_1 = (xf_N_E * xf_N_E).mean(-1, keepdim=True)
    normed_N_E = xf_N_E * torch.rsqrt(variance_N_1 + eps)  # fp32: see the module docstring
    return weight_E * normed_N_E.to(x_N_E.dtype)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the (contiguous) last dimension."""
    return invariant_cuda.row_sum(x) if x.is_cuda else x.sum(-1)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    return row_sum(x) / x.shape[-1] if x.is_cuda else x.mean(-1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, gate) * up


def rotary_tables(
    positions_B_T: torch.Tensor, inv_freq_D2: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, 1, D] of HF's default rotary embedding at these positions, for
    `apply_rotary`: sin with its first half negated (rotate_half's sign)."""
    freqs_B_T_D2 = positions_B_T[..., None].float() * inv_freq_D2.to(positions_B_T.device)
    cos_B_T_D2 = (pointwise(torch.cos, freqs_B_T_D2) * scaling).to(dtype)
    sin_B_T_D2 = (pointwise(torch.sin, freqs_B_T_D2) * scaling).to(dtype)
    cos_B_T_D = torch.cat([cos_B_T_D2, cos_B_T_D2], dim=-1)
    sin_B_T_D = torch.cat([-sin_B_T_D2, sin_B_T_D2], dim=-1)
    return cos_B_T_D[:, :, None], sin_B_T_D[:, :, None]


def apply_rotary(x_B_T_H_D: torch.Tensor, cos_B_T_1_D: torch.Tensor, sin_B_T_1_D: torch.Tensor):
    """HF's x · cos + rotate_half(x) · sin, rotate_half(x) = [-x2, x1] for x = [x1, x2]: here
    [x2, x1] · sin of `rotary_tables` (its sign moved onto sin; IEEE products are symmetric
    in sign, so the bits are the same)."""
    half = x_B_T_H_D.shape[-1] // 2
    return x_B_T_H_D * cos_B_T_1_D + x_B_T_H_D.roll(half, -1) * sin_B_T_1_D


def _left_to_right(parts: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def attention(
    q_B_T_H_D: torch.Tensor,
    k_B_G_W_D: torch.Tensor,
    v_B_G_W_D: torch.Tensor,
    unseen_B_1_M_W: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Causal attention [B, T, H, D]: the query at position p of row b sees that row's keys at
    positions 0..p, key w of `k_B_G_W_D` (heads first, W a multiple of KEY_CHUNK) sitting at
    position w; `unseen_keys` masks the others. Keys past every query may hold anything finite
    in K and V (on the CPU their scores get -inf added, and NaN + -inf is NaN; their weights
    are exact zeros, and NaN · 0 is NaN): see `key_width` and `heads_first`.

    The R = H / G query heads that share a KV head are rows of one GEMM with that head's keys
    (no copy of K or V per query head). Scores are GEMMs over the head dimension (a fixed
    depth); the weighted sum of values is a GEMM per chunk of KEY_CHUNK keys (a fixed depth),
    the chunks then added left to right. Keys past a query have exact zero weights, so a row's
    result does not depend on W: chunks past every query add exact zero sums."""
    if not q_B_T_H_D.is_cuda:
        return _attention_cpu(q_B_T_H_D, k_B_G_W_D, v_B_G_W_D, unseen_B_1_M_W, scaling)
    B, T, H, D = q_B_T_H_D.shape
    G, W = k_B_G_W_D.shape[1:3]
    R, M = H // G, H // G * T
    # rows (r, t) of query head g·R + r at token t, a matrix for each (b, g): X = B·G
    q_X_M_D = q_B_T_H_D.view(B, T, G, R, D).permute(0, 2, 3, 1, 4).reshape(B * G, M, D)
    k_X_W_D = k_B_G_W_D.reshape(B * G, W, D)
    scores_X_M_W = invariant_cuda.matmul(q_X_M_D, k_X_W_D.transpose(-1, -2))
    scores_B_G_M_W = scores_X_M_W.view(B, G, M, W).float() * scaling
    scores_B_G_M_W.masked_fill_(unseen_B_1_M_W, float("-inf"))
    top_B_G_M_1 = scores_B_G_M_W.amax(-1, keepdim=True)
    weights_B_G_M_W = torch.exp(scores_B_G_M_W - top_B_G_M_1)
    probs_B_G_M_W = weights_B_G_M_W / row_sum(weights_B_G_M_W.contiguous())[..., None]
    probs_B_G_M_W = probs_B_G_M_W.to(v_B_G_W_D.dtype).contiguous()
    out_B_G_M_D = invariant_cuda.matmul(probs_B_G_M_W, v_B_G_W_D)
    return out_B_G_M_D.view(B, G, R, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)


def _attention_cpu(
    q_B_T_H_D: torch.Tensor,
    k_B_G_W_D: torch.Tensor,
    v_B_G_W_D: torch.Tensor,
    unseen_B_1_M_W: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`attention` on the CPU: its GEMMs run `_gemm_rows` rows (a GEMM of fewer takes another
    kernel), the value sum one GEMM per chunk of KEY_CHUNK keys, the chunks then added left to
    right. Written for a decode step, whose cost is per op: the query rows are laid out and
    padded in one copy; scale and mask are one op (s · scaling + 0 or -inf rounds only the
    product, fused or not); the probabilities are divided straight into the value sum's padded
    chunk layout."""
    B, T, H, D = q_B_T_H_D.shape
    G, W = k_B_G_W_D.shape[1:3]
    R, M = H // G, H // G * T
    C, rows = W // KEY_CHUNK, _gemm_rows(M)
    fresh = q_B_T_H_D.new_zeros if M < rows else q_B_T_H_D.new_empty
    q_X_M_D = fresh((B * G, rows, D))  # X = B·G matrices, rows (r, t) for query head g·R + r
    q_X_M_D.view(B, G, rows, D)[:, :, :M].view(B, G, R, T, D).copy_(
        q_B_T_H_D.view(B, T, G, R, D).permute(0, 2, 3, 1, 4)
    )
    k_X_D_W = k_B_G_W_D.reshape(B * G, W, D).transpose(1, 2)
    scores_B_G_M_W = torch.bmm(q_X_M_D, k_X_D_W).view(B, G, rows, W)[:, :, :M]
    scores_B_G_M_W = torch.add(unseen_B_1_M_W, scores_B_G_M_W, alpha=scaling)
    top_B_G_M_1 = scores_B_G_M_W.amax(-1, keepdim=True)
    weights_B_G_M_W = pointwise(torch.exp, scores_B_G_M_W - top_B_G_M_1)
    sums_B_G_M = _left_to_right(weights_B_G_M_W.view(B, G, M, C, KEY_CHUNK).sum(-1).unbind(-1))
    # [B, G, C, rows, KEY_CHUNK] @ [B, G, C, KEY_CHUNK, D] in one call, summed over the chunks
    fresh = v_B_G_W_D.new_zeros if M < rows else v_B_G_W_D.new_empty
    probs_B_G_C_M_K = fresh((B, G, C, rows, KEY_CHUNK))
    chunks_B_G_C_M_K = weights_B_G_M_W.view(B, G, M, C, KEY_CHUNK).transpose(2, 3)
    sums_B_G_1_M_1 = sums_B_G_M[:, :, None, :, None]
    if weights_B_G_M_W.requires_grad:  # autograd takes no out=
        probs_B_G_C_M_K[:, :, :, :M] = chunks_B_G_C_M_K / sums_B_G_1_M_1
    else:  # divided in fp32, rounded to V's dtype as it is stored
        torch.div(chunks_B_G_C_M_K, sums_B_G_1_M_1, out=probs_B_G_C_M_K[:, :, :, :M])
    out_N_M_D = torch.bmm(
        probs_B_G_C_M_K.view(B * G * C, rows, KEY_CHUNK),
        v_B_G_W_D.reshape(B * G * C, KEY_CHUNK, D),
    )
    out_B_G_M_D = _left_to_right(out_N_M_D.view(B, G, C, rows, D)[:, :, :, :M].unbind(2))
    return out_B_G_M_D.view(B, G, R, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)


def unseen_keys(q_positions_B_T: torch.Tensor, R: int, W: int) -> torch.Tensor:
    """`attention`'s mask [B, 1, R·T, W] for R query heads a KV head, where key w lies past
    the query of row (r, t): True there on CUDA; on the CPU, fp32 -inf there and 0 elsewhere,
    to add to the scores (exact: s + 0 is s), at a fraction of a masked fill's cost. The same
    for every layer of a forward."""
    keys_W = torch.arange(W, device=q_positions_B_T.device)
    unseen_B_1_M_W = (keys_W > q_positions_B_T.repeat(1, R)[..., None])[:, None]
    if unseen_B_1_M_W.is_cuda:
        return unseen_B_1_M_W
    return torch.zeros(unseen_B_1_M_W.shape).masked_fill_(unseen_B_1_M_W, float("-inf"))


def key_width(keys: int) -> int:
    """The W `attention` takes for `keys` keys: rounded up to whole chunks."""
    return -(-keys // KEY_CHUNK) * KEY_CHUNK


def heads_first(x_B_S_G_D: torch.Tensor) -> torch.Tensor:
    """x as [B, G, W, D] for `attention`, contiguous, zero past its S keys (masked scores still
    pass a zero gradient through them: garbage there would make it NaN)."""
    B, S, G, D = x_B_S_G_D.shape
    out_B_G_W_D = x_B_S_G_D.new_empty(B, G, key_width(S), D)
    out_B_G_W_D[:, :, :S].copy_(x_B_S_G_D.transpose(1, 2))
    out_B_G_W_D[:, :, S:].zero_()
    return out_B_G_W_D


def _gemm_rows(M: int) -> int:
    """The rows a CPU GEMM of attention runs M query rows with: the first of ATTENTION_ROWS
    that holds them, M itself from the largest up."""
    return next((rows for rows in ATTENTION_ROWS if rows >= M), M)
