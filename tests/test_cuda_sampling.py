"""The fused CUDA sampler (`verst.engine.kernels.cuda_sampling`) run on the CPU by Triton's
interpreter, on small vocabularies and small tiles (the interpreter costs milliseconds a
program). The same promises at the real vocabulary, on CUDA: tests/gpu/test_cuda_sampling_cuda.py.

Triton reads TRITON_INTERPRET when it is imported (its own library is decorated then), so
the tests run in a child pytest process started with it set; run with TRITON_INTERPRET=1,
this process runs them itself.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verst.engine.kernels.cuda_sampling import fused_sample
from verst.engine.paged_attention import triton
from verst.engine.sampling import SamplingParams, sample_rows

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(triton is None, reason="needs Triton (its interpreter)")
interpreted = pytest.mark.skipif(not INTERPRETED, reason="run by the interpreter's process")

NEG_INF = float("-inf")


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter's process")
def test_the_kernel_under_tritons_interpreter() -> None:
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", __file__],
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]


# tiles of 8 columns, 2 to a program's chunk: a few chunks a row
small = functools.partial(fused_sample, chunk=16, quads=2)


def seeds(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(seed))


def tempered_log_softmax(logits_B_V: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """What `sample_next_tokens` reports: T = 1 for greedy rows."""
    temp_B = torch.where(temperature_B <= 0, 1.0, temperature_B)
    return torch.log_softmax(logits_B_V.float() / temp_B[:, None], dim=-1)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_equal_log_softmax_and_greedy_rows_take_the_argmax(dtype) -> None:
    logits_B_V = (torch.randn(5, 45, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    logits_B_V[3, 7] = logits_B_V[3, 30] = logits_B_V[3].max() + 1  # a tie: the first wins
    logits_B_V[4, 3:] = NEG_INF  # a grammar mask leaves three tokens
    temperature_B = torch.tensor([1.0, 0.6, 2.5, 0.0, 1.0])
    tokens_B, logprobs_B = small(logits_B_V, temperature_B, seeds(5))
    assert tokens_B.dtype == torch.int64 and logprobs_B.dtype == torch.float32
    assert tokens_B[3] == logits_B_V[3].argmax() == 7
    assert tokens_B[4] < 3
    expected_B = tempered_log_softmax(logits_B_V, temperature_B).gather(1, tokens_B[:, None])
    torch.testing.assert_close(logprobs_B, expected_B[:, 0], atol=1e-5, rtol=0)


@interpreted
def test_every_row_greedy_needs_no_seeds() -> None:
    logits_B_V = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    temperature_B = torch.zeros(3)
    tokens_B, logprobs_B = small(logits_B_V, temperature_B, None)
    assert torch.equal(tokens_B, logits_B_V.argmax(-1))
    expected_B = torch.log_softmax(logits_B_V, -1).gather(1, tokens_B[:, None])[:, 0]
    torch.testing.assert_close(logprobs_B, expected_B, atol=1e-5, rtol=0)


@interpreted
def test_draws_follow_the_tempered_softmax() -> None:
    """A chi-square test of 300 draws (fixed seeds) against softmax(z / T), which the same
    draws fail against softmax(z): the temperature is applied, not only the race."""
    n, temperature = 300, 0.5
    z_V = torch.tensor([2.0, 1.0, 0.5, -1.0, NEG_INF])
    tokens_N, _ = fused_sample(
        z_V.expand(n, -1), torch.full((n,), temperature), seeds(n), chunk=8, quads=2
    )
    counts_V = torch.bincount(tokens_N, minlength=5).double()
    assert counts_V[4] == 0

    def chi_square(probs_V: torch.Tensor) -> float:
        # bins {0}, {1}, {2, 3}: each expects at least 5 draws under either distribution
        observed = torch.stack([counts_V[0], counts_V[1], counts_V[2:].sum()])
        expected = n * torch.stack([probs_V[0], probs_V[1], probs_V[2:].sum()]).double()
        return float(((observed - expected) ** 2 / expected).sum())

    critical = 13.82  # chi-square, 2 degrees of freedom, p = 0.001
    assert chi_square(torch.softmax(z_V / temperature, -1)) < critical
    assert chi_square(torch.softmax(z_V, -1)) > critical


@interpreted
def test_masked_entries_are_never_drawn() -> None:
    logits_B_V = torch.full((32, 40), NEG_INF)
    logits_B_V[:, [5, 22, 39]] = torch.tensor([-80.0, -81.0, -79.5])
    tokens_B, logprobs_B = fused_sample(
        logits_B_V, torch.full((32,), 5.0), seeds(32), chunk=40, quads=2
    )
    assert set(tokens_B.tolist()) == {5, 22, 39}
    assert torch.isfinite(logprobs_B).all()


@interpreted
def test_a_rows_token_depends_on_its_logits_and_seed_alone() -> None:
    """Not on its neighbours, the chunking or the tile: Philox is keyed on (seed, column)."""
    generator = torch.Generator().manual_seed(3)
    logits_B_V = torch.randn(4, 64, generator=generator)
    temperature_B = torch.tensor([1.0, 0.0, 1.5, 1.0])
    seeds_B = seeds(4, seed=9)
    together_B, _ = fused_sample(logits_B_V, temperature_B, seeds_B, chunk=16, quads=2)
    for chunk, quads in [(16, 4), (64, 2), (32, 8)]:
        alone = fused_sample(
            logits_B_V[2:3], temperature_B[2:3], seeds_B[2:3], chunk=chunk, quads=quads
        )[0]
        assert alone[0] == together_B[2]
    draws = fused_sample(
        logits_B_V[2:3].expand(12, -1), torch.full((12,), 1.5), seeds(12, seed=4), chunk=64, quads=2
    )[0]
    assert len(set(draws.tolist())) > 1  # other seeds, other draws


@interpreted
def test_sample_rows_keeps_a_seeded_requests_draws_whatever_shares_the_step() -> None:
    """Through `sample_rows`: the seeded row's token is the same alone and beside a greedy,
    an ordinary and a truncating (top-p, sampled by PyTorch's path) request."""
    logits_B_V = torch.randn(4, 40, generator=torch.Generator().manual_seed(5))
    seeded = SamplingParams(temperature=0.8, sampling_seed=11)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.9),
    ]

    def draw(rows: list[int], params: list[SamplingParams]) -> list[int]:
        own = [torch.Generator().manual_seed(11) if p is seeded else None for p in params]
        shared = torch.Generator().manual_seed(0)
        tokens_B, logprobs_B = sample_rows(logits_B_V[rows], params, own, shared, fused=small)
        expected_B = tempered_log_softmax(
            logits_B_V[rows], torch.tensor([p.temperature for p in params])
        ).gather(1, tokens_B[:, None])[:, 0]
        torch.testing.assert_close(logprobs_B, expected_B, atol=1e-5, rtol=0)
        return tokens_B.tolist()

    alone = draw([0], [seeded])
    beside = draw([1, 2, 0, 3], [others[0], others[1], seeded, others[2]])
    assert beside[2] == alone[0]
    assert beside[0] == logits_B_V[1].argmax()


@interpreted
def test_sample_rows_sends_truncating_rows_to_pytorchs_path() -> None:
    """A seeded top-k row draws what `sample_rows` without the fused sampler draws for it."""
    logits_B_V = torch.randn(2, 40, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=1.0), SamplingParams(top_k=3, sampling_seed=2)]

    def seeded_token(fused) -> int:
        own = [None, torch.Generator().manual_seed(2)]
        tokens_B, _ = sample_rows(logits_B_V, params, own, torch.Generator(), fused=fused)
        return int(tokens_B[1])

    assert seeded_token(small) == seeded_token(None)
    assert seeded_token(small) in logits_B_V[1].topk(3).indices.tolist()


@interpreted
def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        small(torch.zeros(2, 8, dtype=torch.float16), torch.ones(2), seeds(2))
    with pytest.raises(ValueError, match="multiple of 4"):
        fused_sample(torch.zeros(2, 8), torch.ones(2), seeds(2), chunk=12, quads=2)
