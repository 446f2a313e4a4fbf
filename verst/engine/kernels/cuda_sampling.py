"""The engine's sampler on CUDA for rows that do not truncate: one pass over the logits.

PyTorch's path (`sampling.sample_next_tokens`) reads and writes the [B, V] float32 logits about
ten times (cast, temperature, log-softmax, exp, exponential noise, divide, two argmaxes, gather).
`fused_sample` reads them once: each program takes one chunk of one row and keeps, for each
slot of its tile, the running max and sum of exp of z / T (the log-sum-exp) and the best
Gumbel-max score z / T − log(E), E ~ Exp(1); a second, small kernel combines a row's chunks,
reads z at the chosen token again and writes `(token int64, log_softmax(z / T)[token] float32)`
(equal to PyTorch's within float rounding: the sums run in another order).

- Sampled rows (T > 0) draw argmax_i z_i / T − log(E_i), which is a draw from softmax(z / T)
  (the exponential race of `_draw`). E_i comes from Philox (`tl.randint4x`) keyed on the row's
  seed and the column alone, so a row's token depends on its logits and seed only: not on the
  batch, the chunking or the other rows.
- Greedy rows (T ≤ 0) take the argmax of z (first index on ties, as `torch.argmax`) and report
  its log-prob under T = 1, as PyTorch's path does.
- Entries of −inf (grammar masks, `min_new_tokens`) are never drawn.

Chunks of `chunk` columns per program spread one row over many SMs, so a lone row does not
stream 151,936 entries through one SM; `bench/sampling_ab.py` compares chunk sizes.
"""

from __future__ import annotations

import torch

from verst.engine.paged_attention import triton

if triton is not None:
    import triton.language as tl

QUADS = 512  # a program's round: QUADS groups of 4 adjacent columns, one Philox call each
DEFAULT_CHUNK = 8 * QUADS  # columns per program (a multiple of 4 * QUADS)


def fused_sample(
    logits_B_V: torch.Tensor,
    temperature_B: torch.Tensor,
    seeds_B: torch.Tensor | None,
    *,
    chunk: int = DEFAULT_CHUNK,
    quads: int = QUADS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob: `(tokens_B int64, logprobs_B float32)`.

    `logits_B_V`: float32 or bfloat16, rows may be strided; `temperature_B`: ≤ 0 for greedy
    rows; `seeds_B`: int64, one per row, or None when every row is greedy (the kernel then has
    no random draw). `chunk` and `quads` (`quads` a power of two, `chunk` a multiple of
    4 * `quads`) set the work per program; tests shrink them for the interpreter. A row's token
    depends on neither."""
    if triton is None:
        raise RuntimeError("fused_sample needs Triton")
    if logits_B_V.dim() != 2 or logits_B_V.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"logits must be [B, V] float32 or bfloat16, got {logits_B_V.dtype}")
    if quads & (quads - 1) or chunk % (4 * quads):
        raise ValueError(f"chunk {chunk} must be a multiple of 4 * quads ({quads}, a power of 2)")
    if logits_B_V.stride(1) != 1:
        logits_B_V = logits_B_V.contiguous()
    B, V = logits_B_V.shape
    device = logits_B_V.device
    chunks = triton.cdiv(V, chunk)
    max_B_C, sum_B_C, best_B_C = torch.empty((3, B, chunks), dtype=torch.float32, device=device)
    index_B_C = torch.empty((B, chunks), dtype=torch.int32, device=device)
    tokens_B = torch.empty(B, dtype=torch.int64, device=device)
    logprobs_B = torch.empty(B, dtype=torch.float32, device=device)
    if B == 0:
        return tokens_B, logprobs_B
    temperature_B = temperature_B.to(device=device, dtype=torch.float32)
    sampled = seeds_B is not None
    # unread without SAMPLED: any int tensor stands in
    seeds_B = seeds_B.to(device=device, dtype=torch.int64) if sampled else index_B_C
    _chunk_kernel[(B, chunks)](
        logits_B_V, logits_B_V.stride(0), temperature_B, seeds_B, max_B_C, sum_B_C, best_B_C,
        index_B_C, V, chunks, QUADS=quads, ROUNDS=chunk // (4 * quads), SAMPLED=sampled,
        num_warps=4,
    )  # fmt: skip
    _combine_kernel[(B,)](
        logits_B_V, logits_B_V.stride(0), temperature_B, max_B_C, sum_B_C, best_B_C, index_B_C,
        tokens_B, logprobs_B, chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=1,
    )  # fmt: skip
    return tokens_B, logprobs_B


if triton is not None:
    _INDEX_PAD = tl.constexpr(2**31 - 1)  # above any column: loses every min over columns

    @triton.jit
    def _exponential(bits):
        """Exp(1) from 32 random bits, as −log(1 − y) with y uniform in (0, 1): the small E
        that win the race come from small y, where float32 resolves them (a series for
        log1p), instead of from u = 1 − y near 1, where it cannot (E < 2^-24 would be 0)."""
        y = bits.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
        y = tl.minimum(y, 0.99999994)  # bits near 2^32 round y up to 1, and E to inf
        series = y * (1.0 + y * (0.5 + y * (1.0 / 3.0 + y * (0.25 + y * (0.2 + y / 6.0)))))
        return tl.where(y < 0.0625, series, -tl.log(1.0 - y))

    @triton.jit
    def _finite(max_value):
        """A max to subtract: −inf (nothing but −inf seen, whose sums are 0) becomes 0, so
        exp(−inf − max) is 0 instead of NaN."""
        return tl.where(max_value == float("-inf"), 0.0, max_value)

    @triton.jit
    def _take(row_ptr, cols, V, temp, greedy, bits, m, s, best, best_col, SAMPLED: tl.constexpr):
        """Fold one tile of columns into each slot's running state."""
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temp
        # running log-sum-exp with one exp: the larger of (m, x) is the new max
        hi = tl.maximum(m, x)
        d = tl.exp(tl.minimum(m, x) - _finite(hi))
        s = tl.where(x > m, s * d + 1.0, s + d)
        if SAMPLED:
            score = x - tl.where(greedy, 0.0, tl.log(_exponential(bits)))
        else:
            score = x
        # strictly greater: a slot keeps its first column on ties (its columns rise)
        better = score > best
        return hi, s, tl.where(better, score, best), tl.where(better, cols, best_col)

    @triton.jit
    def _chunk_kernel(
        Logits,
        stride_row,
        Temps,
        Seeds,
        Max,
        Sum,
        Best,
        Index,
        V,
        chunks,
        QUADS: tl.constexpr,
        ROUNDS: tl.constexpr,
        SAMPLED: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        temp = tl.load(Temps + row)
        greedy = temp <= 0.0
        temp = tl.where(greedy, 1.0, temp)
        row_ptr = Logits + row.to(tl.int64) * stride_row
        quad = tl.arange(0, QUADS)
        # a round's tile [QUADS, 4]: four adjacent columns a quad, one Philox call each
        tile = 4 * quad[:, None] + tl.arange(0, 4)[None, :]
        m = tl.full([QUADS, 4], float("-inf"), tl.float32)
        s = tl.zeros([QUADS, 4], tl.float32)
        best = tl.full([QUADS, 4], float("-inf"), tl.float32)
        best_col = tl.zeros([QUADS, 4], tl.int32)
        if SAMPLED:
            seed = tl.load(Seeds + row)
        for r in range(ROUNDS):
            start = (chunk * ROUNDS + r) * 4 * QUADS
            if SAMPLED:
                # column c takes word c % 4 of Philox counter c // 4: fixed per column,
                # whatever the chunking
                b0, b1, b2, b3 = tl.randint4x(seed, start // 4 + quad)
                bits = tl.reshape(tl.join(tl.join(b0, b1), tl.join(b2, b3)), [QUADS, 4])
            else:
                bits = tile
            m, s, best, best_col = _take(
                row_ptr, start + tile, V, temp, greedy, bits, m, s, best, best_col, SAMPLED
            )
        chunk_max = tl.max(m)
        chunk_best = tl.max(best)
        at = row * chunks + chunk
        tl.store(Max + at, chunk_max)
        tl.store(Sum + at, tl.sum(s * tl.exp(m - _finite(chunk_max))))
        tl.store(Best + at, chunk_best)
        tl.store(Index + at, tl.min(tl.where(best == chunk_best, best_col, _INDEX_PAD)))

    @triton.jit
    def _combine_kernel(
        Logits,
        stride_row,
        Temps,
        Max,
        Sum,
        Best,
        Index,
        Tokens,
        Logprobs,
        chunks,
        CHUNKS_PAD: tl.constexpr,
    ):
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS_PAD)
        valid = c < chunks
        at = row * chunks + c
        m = tl.load(Max + at, mask=valid, other=float("-inf"))
        s = tl.load(Sum + at, mask=valid, other=0.0)
        best = tl.load(Best + at, mask=valid, other=float("-inf"))
        col = tl.load(Index + at, mask=valid, other=_INDEX_PAD)
        row_max = tl.max(m, axis=0)
        row_sum = tl.sum(s * tl.exp(m - _finite(row_max)), axis=0)
        # chunks rise with the column: the first chunk holding the best score has its first
        token = tl.min(tl.where(best == tl.max(best, axis=0), col, _INDEX_PAD), axis=0)
        temp = tl.load(Temps + row)
        temp = tl.where(temp <= 0.0, 1.0, temp)
        z = tl.load(Logits + row.to(tl.int64) * stride_row + token).to(tl.float32) / temp
        tl.store(Tokens + row, token.to(tl.int64))
        tl.store(Logprobs + row, z - row_max - tl.log(row_sum))
