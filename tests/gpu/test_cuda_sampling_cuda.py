"""The fused sampler (`verst.engine.kernels.cuda_sampling`) on CUDA at Qwen2's vocabulary, and
the scheduler sampling through it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_qwen3
from verst.engine import GenerateRequest, SamplingParams
from verst.engine.kernels.cuda_sampling import DEFAULT_CHUNK, fused_sample
from verst.engine.kv_pool import KVPool
from verst.engine.paged_attention import triton
from verst.engine.sampling import sample_rows
from verst.engine.scheduler import Scheduler

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton"
)

VOCAB = 151_936
NEG_INF = float("-inf")


def seeds(n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 2**62, (n,), generator=generator, device="cuda")


def tempered_log_softmax(logits_B_V: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    temp_B = torch.where(temperature_B <= 0, 1.0, temperature_B)
    return torch.log_softmax(logits_B_V.float() / temp_B[:, None], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_equal_log_softmax_and_greedy_rows_take_the_argmax(dtype) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    B = 64
    # strided rows, as a slice of a wider buffer
    wide_B_W = torch.randn(B, VOCAB + 64, generator=generator, device="cuda") * 2
    logits_B_V = wide_B_W.to(dtype)[:, :VOCAB]
    allowed_K = torch.randperm(VOCAB, generator=generator, device="cuda")[:100]
    masked = torch.full((VOCAB,), NEG_INF, device="cuda", dtype=dtype)
    masked[allowed_K] = logits_B_V[0, allowed_K]
    logits_B_V[:8] = masked  # a grammar mask on the first eight rows
    temperature_B = torch.tensor([0.0, 0.5, 1.0, 1.7], device="cuda").repeat(B // 4)
    tokens_B, logprobs_B = fused_sample(logits_B_V, temperature_B, seeds(B))
    greedy_B = temperature_B == 0
    assert torch.equal(tokens_B[greedy_B], logits_B_V[greedy_B].argmax(-1))
    assert torch.isin(tokens_B[:8], allowed_K).all()
    expected_B = tempered_log_softmax(logits_B_V, temperature_B).gather(1, tokens_B[:, None])
    torch.testing.assert_close(logprobs_B, expected_B[:, 0], atol=1e-5, rtol=1e-6)


def test_draws_follow_the_tempered_softmax() -> None:
    """2^20 draws (16 launches of 65,536 rows reading one row of logits) against
    softmax(z / T): a chi-square over the tokens set at chosen probabilities (down to 1e-4)
    and the rest of the vocabulary as one bin."""
    temperature = 0.8
    chosen_K = torch.tensor([3, 900, 151_935, 40_000, 77, 12_345, 5])
    probs_K = torch.tensor([0.3, 0.2, 0.1, 0.05, 0.01, 1e-3, 1e-4], dtype=torch.float64)
    probs_V = torch.full((VOCAB,), (1 - probs_K.sum()) / (VOCAB - 7), dtype=torch.float64)
    probs_V[chosen_K] = probs_K
    z_V = (probs_V.log() * temperature).float().cuda()
    rows = 65_536
    counts_V = torch.zeros(VOCAB, device="cuda", dtype=torch.float64)
    for launch in range(16):
        tokens_N, _ = fused_sample(
            z_V.expand(rows, -1),
            torch.full((rows,), temperature, device="cuda"),
            seeds(rows, launch),
        )
        counts_V += torch.bincount(tokens_N, minlength=VOCAB)
    n = 16 * rows
    rest_V = torch.ones(VOCAB, dtype=torch.bool)
    rest_V[chosen_K] = False
    observed = torch.cat([counts_V.cpu()[chosen_K], counts_V.cpu()[rest_V].sum()[None]])
    expected = n * torch.cat([probs_K, probs_V[rest_V].sum()[None]])
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 24.32  # 7 degrees of freedom, p = 0.001


def test_masked_entries_are_never_drawn() -> None:
    z_V = torch.full((VOCAB,), NEG_INF, device="cuda")
    allowed = [0, 17, 4096, 80_000, VOCAB - 1]
    z_V[allowed] = torch.tensor([-50.0, -50.5, -49.0, -51.0, -50.0], device="cuda")
    rows = 65_536
    tokens_N, logprobs_N = fused_sample(
        z_V.expand(rows, -1), torch.full((rows,), 3.0, device="cuda"), seeds(rows)
    )
    assert set(tokens_N.unique().tolist()) == set(allowed)
    assert torch.isfinite(logprobs_N).all()


def test_the_chunking_changes_no_token() -> None:
    generator = torch.Generator(device="cuda").manual_seed(1)
    logits_B_V = torch.randn(16, VOCAB, generator=generator, device="cuda")
    temperature_B = torch.full((16,), 1.0, device="cuda")
    seeds_B = seeds(16)
    reference_B, ref_logprobs_B = fused_sample(logits_B_V, temperature_B, seeds_B)
    whole_row = -(-VOCAB // DEFAULT_CHUNK) * DEFAULT_CHUNK
    for chunk in (DEFAULT_CHUNK // 2, 4 * DEFAULT_CHUNK, whole_row):
        tokens_B, logprobs_B = fused_sample(logits_B_V, temperature_B, seeds_B, chunk=chunk)
        assert torch.equal(tokens_B, reference_B)
        torch.testing.assert_close(logprobs_B, ref_logprobs_B, atol=1e-5, rtol=0)


def test_a_seeded_rows_token_ignores_its_batch_mates() -> None:
    """Through `sample_rows`: the same token alone and among 63 others, some of them
    truncating (PyTorch's path)."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    logits_B_V = torch.randn(64, VOCAB, generator=generator, device="cuda")
    seeded = SamplingParams(temperature=1.0, sampling_seed=7)
    mates = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)] * 28 + [
        SamplingParams(temperature=1.0, top_p=0.9)
    ] * 7

    def token(rows: list[int], params: list[SamplingParams]) -> int:
        own = [
            torch.Generator(device="cuda").manual_seed(7) if p is seeded else None for p in params
        ]
        shared = torch.Generator(device="cuda").manual_seed(len(rows))
        tokens_B, _ = sample_rows(logits_B_V[rows], params, own, shared, fused=fused_sample)
        return int(tokens_B[params.index(seeded)])

    alone = token([40], [seeded])
    assert token(list(range(64)), mates[:40] + [seeded] + mates[40:]) == alone


def scheduler(model, **kw) -> Scheduler:
    pool = KVPool(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        num_pages=256,
        dtype=torch.float32,
        device="cuda",
    )
    return Scheduler(model, pool, eos_token_ids=[63], pad_token_id=0, **kw)


def prompts() -> list[list[int]]:
    return [[(i * 7 + j * 3) % 60 + 1 for j in range(n)] for i, n in enumerate([5, 11, 2, 30])]


def test_the_scheduler_samples_through_the_kernel_and_greedy_output_is_unchanged() -> None:
    model = tiny_qwen3().to("cuda")
    fused, plain = scheduler(model), scheduler(model)
    assert fused.fused_sampler is fused_sample
    plain.fused_sampler = None
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = [
        s.generate([GenerateRequest(input_ids=p, sampling_params=params) for p in prompts()])
        for s in (fused, plain)
    ]
    for mine, theirs in zip(*outs, strict=True):
        assert mine.output_ids == theirs.output_ids
        torch.testing.assert_close(
            torch.tensor(mine.output_token_logprobs),
            torch.tensor(theirs.output_token_logprobs),
            atol=1e-5,
            rtol=0,
        )


def test_true_on_policy_keeps_pytorchs_sampler() -> None:
    assert scheduler(tiny_qwen3().to("cuda"), true_on_policy=True).fused_sampler is None


def test_a_seeded_request_ignores_its_batch_mates_in_the_scheduler() -> None:
    model = tiny_qwen3().to("cuda")
    seeded = SamplingParams(max_new_tokens=12, ignore_eos=True, sampling_seed=11)
    alone = scheduler(model, seed=1).generate(
        [GenerateRequest(input_ids=prompts()[1], sampling_params=seeded)]
    )[0]
    mates = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, top_k=5)]
    crowd = scheduler(model, seed=2).generate(
        [
            GenerateRequest(input_ids=p, sampling_params=mates[i % 2])
            for i, p in enumerate(prompts())
        ]
        + [GenerateRequest(input_ids=prompts()[1], sampling_params=seeded)]
    )[-1]
    assert crowd.output_ids == alone.output_ids
