"""Decode attention on CUDA: one query token a row against its KV pages, read in place.

`paged_decode_triton` runs one program per row and KV head (its query heads together) over the
row's keys in blocks of 64, the online softmax of flash attention. With few rows that is few
programs, each walking the whole sequence: one row of a model with two KV heads runs on two of
the GPU's 132 SMs, and a 4,096-token row takes 64 blocks in turn. So where rows × KV heads leave
most SMs idle, the sequence is split (flash decoding): each of `splits` programs per row and
head takes an even share of its blocks and writes its partial output and log-sum-exp; a second
kernel weighs the shares into the output. The split count depends only on the batch and table
shapes, so a CUDA graph captures it; each program reads its row's length on the device.
"""

from __future__ import annotations

import torch

from verst.engine.paged_attention import triton

if triton is not None:
    import triton.language as tl

BLOCK_N = 64  # keys a program scores at once
MAX_SPLITS = 16
# below this many programs (rows x KV heads) a call splits its sequences: about one per SM
TARGET_PROGRAMS = 128


def decode_splits(rows: int, kv_heads: int, table_pages: int, page: int) -> int:
    """How many programs share each row and KV head's sequence (a power of two): enough for
    `TARGET_PROGRAMS` in all, no more than the blocks a full page table holds."""
    blocks = -(-table_pages * page // BLOCK_N)
    wanted = min(-(-TARGET_PROGRAMS // (rows * kv_heads)), MAX_SPLITS, blocks)
    return 1 << (wanted - 1).bit_length()


def paged_decode_triton(
    q_B_H_D: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table_B_P: torch.Tensor,
    seq_lens_B: torch.Tensor,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """One query token a row over its pages: [B, Hq, D] out. k/v_pages [pages, page, Hkv, D].
    `splits`: programs per row and KV head (a power of two; None: `decode_splits`)."""
    if triton is None:
        raise RuntimeError("the paged decode kernel needs Triton")
    B, Hq, D = q_B_H_D.shape
    _, page, Hkv, _ = k_pages.shape
    if splits is None:
        splits = decode_splits(B, Hkv, table_B_P.shape[1], page)
    if splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    group = Hq // Hkv
    out = torch.empty((B, Hq, D), dtype=q_B_H_D.dtype, device=q_B_H_D.device)
    q_B_H_D = q_B_H_D.to(k_pages.dtype)
    # with splits, each share's output (normalised by its own sum) and log-sum-exp, in fp32;
    # without, the kernel writes the output itself (and reads no log-sum-exp buffer)
    parts, lse = out.unsqueeze(2), out
    if splits > 1:
        parts = torch.empty((B, Hq, splits, D), dtype=torch.float32, device=out.device)
        lse = torch.empty((B, Hq, splits), dtype=torch.float32, device=out.device)
    _paged_decode_kernel[(B, Hkv, splits)](
        q_B_H_D, k_pages, v_pages, parts, lse, table_B_P, seq_lens_B, scale,
        q_B_H_D.stride(0), q_B_H_D.stride(1), k_pages.stride(0), k_pages.stride(1),
        k_pages.stride(2), table_B_P.stride(0), *parts.stride()[:3],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), PAGE=page, D=D,
        BLOCK_N=BLOCK_N, SPLITS=splits,
        # fp32 pools get fp32 products (tl.dot would otherwise round inputs to TF32)
        PRECISION="ieee" if k_pages.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(B, Hq)](parts, lse, out, out.stride(0), out.stride(1), SPLITS=splits, D=D)
    return out


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        Q, K, V, Out, Lse, Table, SeqLens, scale, stride_qb, stride_qh, stride_kp, stride_ks,
        stride_kh, stride_tb, stride_ob, stride_oh, stride_os, GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(SeqLens + b)
        # this program's share of the row's blocks: [first, last) in keys
        share = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), SPLITS) * BLOCK_N
        first = split * share
        last = tl.minimum(first + share, seq_len)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D)
        heads = kv_head * GROUP + offs_g
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=offs_g[:, None] < GROUP,
            other=0.0,
        )
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, D], dtype=tl.float32)
        for start in range(first, last, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid_n = offs_n < last
            page = tl.load(Table + b * stride_tb + offs_n // PAGE, mask=valid_n, other=0)
            base = page * stride_kp + (offs_n % PAGE) * stride_ks + kv_head * stride_kh
            k = tl.load(K + base[:, None] + offs_d[None, :], mask=valid_n[:, None], other=0.0)
            v = tl.load(V + base[:, None] + offs_d[None, :], mask=valid_n[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            s = tl.where(valid_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(
                tl.float32
            )
            m_i = m_new
        valid_g = offs_g < GROUP
        if SPLITS == 1:
            out = (acc / l_i[:, None]).to(Out.dtype.element_ty)
        else:  # an empty share (past the row's length) has l = 0: output 0, weight exp(-inf)
            out = acc / tl.maximum(l_i, 1e-30)[:, None]
            lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
            tl.store(Lse + (b * GROUP * tl.num_programs(1) + heads) * SPLITS + split, lse, valid_g)
        where = Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
        tl.store(where + offs_d[None, :], out, mask=valid_g[:, None])

    @triton.jit
    def _combine_kernel(
        Parts, Lse, Out, stride_ob, stride_oh, SPLITS: tl.constexpr, D: tl.constexpr
    ):
        """Program (row, query head): the shares' outputs weighed by exp(lse - max lse)."""
        b = tl.program_id(0)
        head = tl.program_id(1)
        row = b * tl.num_programs(1) + head
        offs_s = tl.arange(0, SPLITS)
        lse = tl.load(Lse + row * SPLITS + offs_s)
        weights = tl.exp(lse - tl.max(lse, 0))
        weights = weights / tl.sum(weights, 0)
        offs_d = tl.arange(0, D)
        parts = tl.load(Parts + (row * SPLITS + offs_s[:, None]) * D + offs_d[None, :])
        out = tl.sum(parts * weights[:, None], 0)
        tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))
