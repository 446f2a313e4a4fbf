"""Sampling parameters and the batched next-token sampler.

Owns `SamplingParams` (SGLang's field names), `RowPenalties` with `apply_penalties` (SGLang's
frequency / presence / repetition penalties, `min_new_tokens` and `logit_bias` as tensor ops
over per-row state) and `sample_next_tokens`, which draws one token per row with per-row
temperature / top-p / top-k, without Python loops or host syncs. `sample_rows` runs a step's
rows; on CUDA it hands those that do not truncate to one fused kernel
(`kernels.cuda_sampling`), which keeps the promise below within float rounding.

Promise: the log-prob returned for a token is that of the distribution the token was drawn
from, before truncation: `log_softmax(z / T)[token]` over the full vocabulary in float32, where
z is the model's logits after the request's penalties and logit bias (z = logits when it has
none), and T = 1 for greedy rows (T == 0). Without penalties this is exactly what the trainer
recomputes. With them it is not: the trainer scores the model alone, so an RL rollout must not
use penalties (verst's rollout has no setting for them and the session server refuses them);
they are for serving and evaluation, and SGLang reports the same post-penalty log-prob.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verst.engine.grammar import Constraint

SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed takes [-2^63, 2^64); seeds are [0, 2^64)
PENALTY_LIMIT = 2.0  # SGLang's range: frequency / presence in [-2, 2], repetition in (0, 2]
_SEED_DRAW_LIMIT = (1 << 63) - 1  # the fused sampler's per-row seeds: non-negative int64

# (logits_B_V, temperature_B, seeds_B or None when every row is greedy) -> (tokens_B, logprobs_B)
FusedSampler = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p × the likeliest one
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the engine's EOS
    ignore_eos: bool = False
    sampling_seed: int | None = None  # a request with a seed samples reproducibly on its own
    # The penalties change the distribution sampled from (see the module docstring).
    min_new_tokens: int = 0  # the stop tokens (and EOS) are blocked until this many are out
    frequency_penalty: float = 0.0  # subtracted from a token's logit per time it was output
    presence_penalty: float = 0.0  # subtracted once from the logit of every token output
    repetition_penalty: float = 1.0  # output tokens' logits: positive / it, negative * it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # the output must match it (SGLang's json_schema / regex / ebnf); masks the distribution
    constraint: Constraint | None = None

    def validate(self) -> None:
        """Raise ValueError naming the offending field (types too: a bool is not a number)."""
        for name in ("max_new_tokens", "top_k", "min_new_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        seed = self.sampling_seed
        if seed is not None and not (_is_int(seed) and 0 <= seed < SEED_LIMIT):
            raise ValueError(f"sampling_seed must be an int in [0, 2^64), got {seed!r}")
        self._validate_penalties()
        if self.constraint is not None:
            self.constraint.validate()

    def _validate_penalties(self) -> None:
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= PENALTY_LIMIT:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(
                f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}"
            )
        for token, bias in self.logit_bias.items():
            if not (_is_int(token) and token >= 0):
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not _is_number(bias) or not math.isfinite(bias):
                raise ValueError(f"logit_bias[{token}] must be a finite number, got {bias!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes this request's logits (it then holds per-row
        state in the scheduler)."""
        return bool(
            self.min_new_tokens
            or self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-p, top-k or min-p cut the distribution (the fused sampler does not)."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class RowPenalties:
    """The penalty state of each row of one sampling call (gathered from the scheduler's
    per-request slots, `verst.engine.penalties`). A field is None when no row uses it, and its
    op is skipped; a row without penalties has zero counts, penalties 0 / 1 and no bias."""

    counts_B_V: torch.Tensor | None = None  # float32: times each token is in the row's output
    frequency_B: torch.Tensor | None = None
    presence_B: torch.Tensor | None = None
    repetition_B: torch.Tensor | None = None
    blocked_B_V: torch.Tensor | None = None  # bool: stop tokens min_new_tokens holds back now
    bias_B_V: torch.Tensor | None = None  # float32: logit_bias


def apply_penalties(logits_B_V: torch.Tensor, pen: RowPenalties) -> torch.Tensor:
    """SGLang's order and formulas, on float32 logits z (OpenAI's for the first two):
    z -= frequency * count + presence * (count > 0); then for tokens already output,
    z = z / repetition where z > 0 else z * repetition; stop tokens blocked by min_new_tokens
    -> -inf; z += logit_bias. Returns a new tensor."""
    z_B_V = logits_B_V.float()
    counts_B_V = pen.counts_B_V
    if counts_B_V is not None:
        seen_B_V = counts_B_V > 0
    if pen.frequency_B is not None and counts_B_V is not None:
        z_B_V = z_B_V - pen.frequency_B.unsqueeze(-1) * counts_B_V
    if pen.presence_B is not None and counts_B_V is not None:
        z_B_V = z_B_V - pen.presence_B.unsqueeze(-1) * seen_B_V
    if pen.repetition_B is not None and counts_B_V is not None:
        rep_B_1 = pen.repetition_B.unsqueeze(-1)
        scaled_B_V = torch.where(z_B_V > 0, z_B_V / rep_B_1, z_B_V * rep_B_1)
        z_B_V = torch.where(seen_B_V, scaled_B_V, z_B_V)
    if pen.blocked_B_V is not None:
        z_B_V = z_B_V.masked_fill(pen.blocked_B_V, float("-inf"))
    if pen.bias_B_V is not None:
        z_B_V = z_B_V + pen.bias_B_V
    return z_B_V


def sample_next_tokens(
    logits_B_V: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor | None,
    top_k_B: torch.Tensor | None,
    generator: torch.Generator | None,
    *,
    any_sampled: bool = True,
    min_p_B: torch.Tensor | None = None,
    any_greedy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return `(tokens_B int64, logprobs_B float32)`.

    `top_p_B` / `top_k_B` may be None when no row truncates (the caller knows this on the host),
    which skips the vocabulary sort. Rows with temperature 0 take the argmax; `any_sampled=False`
    (every row greedy, known on the host) skips the random draw entirely, and
    `any_greedy=False` (no row greedy) skips the argmax.
    """
    logits_B_V = logits_B_V.float()
    greedy_B = temperature_B <= 0
    # Greedy rows divide by 1 so their log-probs are plain log_softmax(logits).
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()
    scaled_B_V = logits_B_V / temp_B.unsqueeze(-1)
    logprobs_B_V = torch.log_softmax(scaled_B_V, dim=-1)
    if not any_sampled:
        tokens_B = logits_B_V.argmax(dim=-1)
        return tokens_B, logprobs_B_V.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1)
    probs_B_V = logprobs_B_V.exp()

    # Multinomial sampling without a host sync (`_draw`).
    if top_p_B is None and top_k_B is None and min_p_B is None:
        sampled_B = _draw(probs_B_V, generator)
    else:
        probs_sorted_B_V, idx_sorted_B_V = probs_B_V.sort(dim=-1, descending=True)
        vocab = probs_B_V.shape[-1]
        if top_k_B is not None:
            ranks_V = torch.arange(vocab, device=probs_B_V.device)
            k_B = torch.where(top_k_B > 0, top_k_B, vocab)
            probs_sorted_B_V = probs_sorted_B_V.masked_fill(
                ranks_V.unsqueeze(0) >= k_B.unsqueeze(-1), 0.0
            )
        if top_p_B is not None:
            # Same rule as SGLang: drop a token once the mass strictly before it exceeds top_p;
            # the most likely token always survives.
            before_B_V = probs_sorted_B_V.cumsum(dim=-1) - probs_sorted_B_V
            probs_sorted_B_V = probs_sorted_B_V.masked_fill(
                before_B_V > top_p_B.float().unsqueeze(-1), 0.0
            )
        if min_p_B is not None:
            floor_B_1 = min_p_B.float().unsqueeze(-1) * probs_sorted_B_V[:, :1]
            probs_sorted_B_V = probs_sorted_B_V.masked_fill(probs_sorted_B_V < floor_B_1, 0.0)
        pick_B = _draw(probs_sorted_B_V, generator)
        sampled_B = idx_sorted_B_V.gather(-1, pick_B.unsqueeze(-1)).squeeze(-1)

    tokens_B = sampled_B
    if any_greedy:
        tokens_B = torch.where(greedy_B, logits_B_V.argmax(dim=-1), sampled_B)
    token_logprobs_B = logprobs_B_V.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1)
    return tokens_B, token_logprobs_B


def _draw(weights_B_V: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row, with probability proportional to its (unnormalised) weight.

    CUDA: the exponential race (argmax of w / Exp(1)), a few elementwise passes. CPU: one
    uniform per row against the cumulative weights (inverse CDF), since a random number per
    vocabulary entry costs more there than the model's last layer. Both sample exactly.
    """
    if weights_B_V.device.type == "cuda":
        noise_B_V = torch.empty_like(weights_B_V).exponential_(generator=generator)
        return (weights_B_V / noise_B_V).argmax(dim=-1)
    cdf_B_V = weights_B_V.cumsum(dim=-1)
    u_B_1 = torch.rand((weights_B_V.shape[0], 1), generator=generator, device=weights_B_V.device)
    # side="right": the first entry whose cumulative weight exceeds u * total, so entries of
    # weight zero (truncated) are never drawn, u = 0 included
    index_B = torch.searchsorted(cdf_B_V, u_B_1 * cdf_B_V[:, -1:], right=True).squeeze(-1)
    return index_B.clamp(max=weights_B_V.shape[-1] - 1)


def sample_rows(
    logits_B_V: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    generator: torch.Generator,
    penalties: RowPenalties | None = None,
    *,
    fused: FusedSampler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row under that row's sampling parameters: `(tokens_B, logprobs_B)`.

    Rows draw from `generator` together; a row with a generator of its own (a request with a
    seed) draws from that one alone, so its tokens do not depend on which other requests
    share the step. `penalties` (None when no row has any) change the logits first, and the
    log-probs are of the penalized distribution (module docstring).

    `fused` (`kernels.cuda_sampling.fused_sample`, CUDA only) samples every row that does not
    truncate in one pass over the logits, from one seed per row; truncating rows take
    `sample_next_tokens` whatever their neighbours, so each row's draw depends on its own
    parameters only."""
    if penalties is not None:
        logits_B_V = apply_penalties(logits_B_V, penalties)
    truncating = [row for row, p in enumerate(params) if p.truncates]
    if fused is None or len(truncating) == len(params):
        return _sample_unfused(logits_B_V, params, generators, generator)
    device = logits_B_V.device
    temperature_B = torch.tensor([p.temperature for p in params], device=device)
    seeds_B = None
    if any(p.temperature > 0 for p in params):
        seeds_B = row_seeds(generators, generator, params, device)
    tokens_B, logprobs_B = fused(logits_B_V, temperature_B, seeds_B)
    if truncating:
        rows_R = torch.tensor(truncating, device=device)
        tokens_R, logprobs_R = _sample_unfused(
            logits_B_V[rows_R],
            [params[row] for row in truncating],
            [generators[row] for row in truncating],
            generator,
        )
        tokens_B[rows_R], logprobs_B[rows_R] = tokens_R, logprobs_R
    return tokens_B, logprobs_B


def row_seeds(
    generators: list[torch.Generator | None],
    generator: torch.Generator,
    params: list[SamplingParams],
    device: torch.device,
) -> torch.Tensor:
    """One int64 seed per row for the fused sampler, drawn on the device (no host sync): from
    `generator` for all rows at once, then, for a sampled row with a generator of its own,
    from that one (a greedy row's own generator is left as it is)."""
    seeds_B = torch.randint(0, _SEED_DRAW_LIMIT, (len(params),), generator=generator, device=device)
    for row, (own, p) in enumerate(zip(generators, params, strict=True)):
        if own is not None and p.temperature > 0:
            seeds_B[row : row + 1] = torch.randint(
                0, _SEED_DRAW_LIMIT, (1,), generator=own, device=device
            )
    return seeds_B


def _sample_unfused(
    logits_B_V: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows` through `sample_next_tokens`: the rows together, then each row with a
    generator of its own again, alone."""
    device = logits_B_V.device
    temperature_B = torch.tensor([p.temperature for p in params], device=device)
    top_p_B = top_k_B = min_p_B = None
    if any(p.top_p < 1.0 for p in params):
        top_p_B = torch.tensor([p.top_p for p in params], device=device)
    if any(p.top_k > 0 for p in params):
        top_k_B = torch.tensor([p.top_k for p in params], device=device)
    if any(p.min_p > 0 for p in params):
        min_p_B = torch.tensor([p.min_p for p in params], device=device)
    tokens_B, logprobs_B = sample_next_tokens(
        logits_B_V,
        temperature_B,
        top_p_B,
        top_k_B,
        generator,
        any_sampled=any(p.temperature > 0 for p in params),
        any_greedy=any(p.temperature <= 0 for p in params),
        min_p_B=min_p_B,
    )
    for row, own in enumerate(generators):
        if own is not None:
            # its own truncation only: the sorted draw (a batch mate truncating) picks
            # another token for the same random number
            one, p = slice(row, row + 1), params[row]
            token, logprob = sample_next_tokens(
                logits_B_V[one],
                temperature_B[one],
                None if top_p_B is None or p.top_p >= 1.0 else top_p_B[one],
                None if top_k_B is None or p.top_k <= 0 else top_k_B[one],
                own,
                min_p_B=None if min_p_B is None or p.min_p <= 0 else min_p_B[one],
            )
            tokens_B[row], logprobs_B[row] = token[0], logprob[0]
    return tokens_B, logprobs_B
