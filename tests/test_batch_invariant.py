"""Batch invariance of each op of `verst.models.batch_invariant` and of the invariant forward:
a row's result is bitwise the same whatever shares the call (torch.equal, never allclose)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.test_trainer import TINY
from verst.models import batch_invariant as bi
from verst.models.invariant_forward import InvariantDecoder, covers, own_keys
from verst.models.tiny import TinyModelConfig, build_tiny_model

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 32).to(dtype), torch.randn(96).to(dtype)
    x = torch.randn(300, 32).to(dtype)
    alone = torch.cat([bi.linear(x[i : i + 1], weight, bias) for i in range(40)])
    for rows in (2, 3, 15, 16, 17, 40, 300):
        assert torch.equal(bi.linear(x[:rows], weight, bias)[:40], alone[:rows])
    # another row order puts each row elsewhere in the GEMM's tiles
    order = torch.randperm(300)
    assert torch.equal(bi.linear(x[order], weight, bias), bi.linear(x, weight, bias)[order])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_and_norm_rows_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(0)
    x = (torch.randn(2000, 64) * 3).to(dtype)
    weight = torch.randn(64).to(dtype)
    for fn in (F.silu, torch.exp, torch.rsqrt):
        whole = bi.pointwise(fn, x.abs() + 0.1)
        for i in (0, 7, 1999):
            assert torch.equal(bi.pointwise(fn, x[i : i + 1].abs() + 0.1), whole[i : i + 1])
    whole = bi.rms_norm(x, weight, 1e-6)
    for rows in (1, 3, 33):
        assert torch.equal(bi.rms_norm(x[:rows], weight, 1e-6), whole[:rows])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_calls_of_a_whole_chunk_match_each_element_alone(threads, dtype):
    """A call of POINTWISE_CHUNK elements (ATen's grain size less 64) runs on one thread
    through the vectorised loop: every element comes out as in a call of its own 64."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (bi.POINTWISE_CHUNK, 2 * bi.POINTWISE_CHUNK + 640):
            x = (torch.randn(n // 64, 64) * 4).to(dtype)
            for fn in (F.silu, torch.exp):
                whole = bi.pointwise(fn, x)
                alone = torch.cat([bi.pointwise(fn, row[None]) for row in x])
                assert torch.equal(whole, alone)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_gemm_rows_from_its_tile_up_do_not_depend_on_the_count(threads, dtype):
    """Attention's GEMMs run with 4, 8, 12 or more rows (ATTENTION_ROWS): a row comes out
    the same in a GEMM of 4, 8 or 12 rows as in one of hundreds (one matrix or a batch, on 1
    or 2 threads, which split one matrix's rows between them), at both GEMMs' shapes (depth a
    head's width, columns the keys; depth KEY_CHUNK, columns a head's width)."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for X, K, N in [(1, 64, 48), (1, 16, 32), (3, 128, 640), (64, 16, 64), (2, 32, 16)]:
            b = torch.randn(X, K, N).to(dtype)
            a = torch.randn(X, 300, K).to(dtype)
            whole = torch.matmul(a, b)
            for start, count in itertools.product((0, 5, 280), bi.ATTENTION_ROWS):
                rows = a[:, start : start + count]
                assert torch.equal(torch.matmul(rows, b), whole[:, start : start + count])
    finally:
        torch.set_num_threads(before)


def test_log_softmax_rows_do_not_depend_on_the_batch():
    """The sampler's fp32 log-softmax: what the engine reports for one row is what the
    trainer computes for that row among thousands."""
    torch.manual_seed(0)
    z = torch.randn(3000, 151) * 5
    whole = torch.log_softmax(z, dim=-1)
    for i in (0, 5, 2999):
        assert torch.equal(torch.log_softmax(z[i : i + 1], dim=-1), whole[i : i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 32, 64])  # 32 and 64 failed while a product was strided
@pytest.mark.parametrize("extra", [0, 9, 40])
def test_attention_of_a_query_ignores_later_keys_and_other_rows(dtype, D, extra):
    """A decode query over its keys 0..p equals that query inside a full causal pass over a
    longer sequence, in a batch with other rows, however many keys past it are read (`extra`:
    garbage there, huge keys and values, adds exact zeros; a CUDA graph reads them)."""
    check_attention(dtype, D, 37, range(37), extra)


def test_attention_over_long_sequences():
    """Keys far past one GEMM block: 600 keys, queries early, mid and last."""
    check_attention(torch.float32, 32, 600, [0, 17, 255, 256, 511, 599])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B, T, H, G, S",
    [
        (1, 1, 4, 2, 5),
        (3, 1, 4, 2, 40),
        (64, 1, 4, 2, 47),
        (2, 7, 4, 2, 20),
        (3, 33, 8, 2, 33),
        (4, 1, 2, 2, 17),
    ],
)
def test_cpu_attention_is_the_plain_ops_bit_for_bit(dtype, B, T, H, G, S):
    """The CPU's attention, its copies folded for a decode step (rows laid out and padded in
    one copy, scale and mask in one op, the division written into the value sum's chunks),
    gives the bits of the same math as plain ops, with autograd on or off."""
    torch.manual_seed(B + T)
    D = 32
    q = torch.randn(B, T, H, D).to(dtype)
    k, v = (
        bi.heads_first(torch.randn(B, S, G, D).to(dtype)),
        bi.heads_first(torch.randn(B, S, G, D).to(dtype)),
    )
    unseen = bi.unseen_keys((torch.arange(T) + S - T).expand(B, T), H // G, k.shape[2])
    plain = plain_attention(q, k, v, unseen, 0.17)
    assert torch.equal(bi.attention(q, k, v, unseen, 0.17), plain)
    with torch.enable_grad():
        out = bi.attention(q.clone().requires_grad_(), k, v, unseen, 0.17)
    assert torch.equal(out.detach(), plain)


def plain_attention(q, k, v, unseen, scaling):
    """`bi.attention`'s CPU math one plain op at a time: GEMMs of `ATTENTION_ROWS` rows, the
    softmax's sum and the value sum in chunks of KEY_CHUNK keys added left to right."""
    (B, T, H, D), (G, W) = q.shape, k.shape[1:3]
    R, M, C = H // G, H // G * T, W // bi.KEY_CHUNK
    rows = next((r for r in bi.ATTENTION_ROWS if r >= M), M)
    q_X_M_D = q.view(B, T, G, R, D).permute(0, 2, 3, 1, 4).reshape(B * G, M, D)
    q_X_M_D = F.pad(q_X_M_D, (0, 0, 0, rows - M))
    scores = torch.matmul(q_X_M_D, k.reshape(B * G, W, D).transpose(1, 2))[:, :M]
    scores = scores.reshape(B, G, M, W).float() * scaling + unseen
    weights = bi.pointwise(torch.exp, scores - scores.amax(-1, keepdim=True))
    sums = weights.unflatten(-1, (C, bi.KEY_CHUNK)).sum(-1)
    probs = (weights / sum(sums.unbind(-1))[..., None]).to(v.dtype)
    chunks = F.pad(probs.unflatten(-1, (C, bi.KEY_CHUNK)).transpose(2, 3), (0, 0, 0, rows - M))
    out = torch.matmul(chunks, v.reshape(B, G, C, bi.KEY_CHUNK, D))[:, :, :, :M]
    out = sum(out.unbind(2))
    return out.view(B, G, R, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)


def check_attention(dtype: torch.dtype, D: int, T: int, queries, extra: int = 0) -> None:
    torch.manual_seed(0)
    B, H, G = 3, 4, 2
    q = torch.randn(B, T, H, D).to(dtype)
    k, v = torch.randn(B, T, G, D).to(dtype), torch.randn(B, T, G, D).to(dtype)
    positions = torch.arange(T).expand(B, T)
    k_B_G_W_D, v_B_G_W_D = bi.heads_first(k), bi.heads_first(v)
    unseen = bi.unseen_keys(positions, H // G, k_B_G_W_D.shape[2])
    full = bi.attention(q, k_B_G_W_D, v_B_G_W_D, unseen, 0.25)
    for p in queries:
        # row 1's query at p alone, its keys padded with garbage past p
        width = bi.key_width(p + 1 + extra)
        keys_k = torch.full((1, G, width, D), 1e4).to(dtype)
        keys_v = torch.full((1, G, width, D), -3e4).to(dtype)
        keys_k[:, :, : p + 1] = k[1:2, : p + 1].transpose(1, 2)
        keys_v[:, :, : p + 1] = v[1:2, : p + 1].transpose(1, 2)
        unseen = bi.unseen_keys(torch.tensor([[p]]), H // G, width)
        one = bi.attention(q[1:2, p : p + 1], keys_k, keys_v, unseen, 0.25)
        assert torch.equal(one[0, 0], full[1, p])


def tiny(family: str, dtype: torch.dtype) -> torch.nn.Module:
    cfg = TinyModelConfig(**TINY.model_dump(exclude={"family"}), family=family)
    return build_tiny_model(cfg, vocab_size=40, seed=0).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_qkv_as_one_gemm_gives_the_bits_of_three(family, dtype):
    """The CPU's Q/K/V from one GEMM of the stacked weights, Q and K normed and rotated as one
    tensor, are bitwise the three GEMMs, two norms and two rotations run apart (CUDA's way), at
    the engine's decode rows and the trainer's whole sequences."""
    model = tiny(family, dtype)
    decoder = InvariantDecoder(model)
    attn = model.get_decoder().layers[1].self_attn
    torch.manual_seed(2)
    for B, T in [(3, 1), (1, 7), (4, 33)]:
        h = torch.randn(B, T, model.config.hidden_size).to(dtype)
        positions = torch.randint(0, 60, (B, T))
        rotary = bi.rotary_tables(positions, decoder.inv_freq_D2, 1.0, dtype)
        with torch.no_grad():
            together = decoder._qkv_together(attn, h, rotary)
            apart = decoder._qkv_apart(attn, h, rotary)
        assert all(torch.equal(a, b) for a, b in zip(together, apart, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "qwen3-moe"])
def test_forward_incremental_equals_whole_sequence(family, dtype):
    """Prefill of 7 tokens then one-token decode steps (the engine's way) give the logits of
    one forward over whole sequences in a batch (the trainer's way), bitwise; and they are
    HF's up to rounding."""
    model = tiny(family, dtype)
    decoder = InvariantDecoder(model)
    torch.manual_seed(1)
    B, L = 5, 30
    ids = torch.randint(0, 40, (B, L))
    positions = torch.arange(L).expand(B, L)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keys(layer, k, v):
        old_k, old_v = cache.get(layer, (k[:, :0], v[:, :0]))
        cache[layer] = (torch.cat([old_k, k], 1), torch.cat([old_v, v], 1))
        return bi.heads_first(cache[layer][0]), bi.heads_first(cache[layer][1])

    with torch.no_grad():
        whole = decoder.hidden(ids, positions, own_keys)
        whole = decoder.logits(whole.reshape(B * L, -1)).view(B, L, -1)
        steps = [decoder.hidden(ids[2:3, :7], positions[2:3, :7], keys)]
        steps += [decoder.hidden(ids[2:3, t : t + 1], positions[2:3, t : t + 1], keys)
                  for t in range(7, L)]  # fmt: skip
        incremental = decoder.logits(torch.cat(steps, dim=1)[0])
        hf = model(ids).logits.float()
    assert torch.equal(incremental, whole[2])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (whole - hf).abs().max() < tolerance


def test_models_it_cannot_read_are_named():
    mistral = tiny("mistral", torch.float32)
    assert "sliding_window" in covers(mistral)
    with pytest.raises(ValueError, match="sliding_window"):
        InvariantDecoder(mistral)
    assert "gemma3" in covers(tiny("gemma3", torch.float32))
    assert covers(tiny("qwen3-moe", torch.float32)) is None
