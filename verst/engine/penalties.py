"""Per-request penalty state on the device, read and updated by the batched sampler.

Owns `PenaltySlots`: one row (a slot) for each request that uses a frequency, presence or
repetition penalty, `min_new_tokens` or `logit_bias`, in tensors on the engine's device: how
many times each token is in its output (scatter-updated after every sampled token), how many
tokens it has generated, its penalty values, the stop tokens `min_new_tokens` holds back and
its bias. Slot 0 is a neutral row (no counts, no penalty, no bias) that rows without penalties
read, so a step gathers every row's state with one index, and no step loops over requests to
apply them. Nothing is allocated before the first such request, and a step none of whose rows
holds a slot never comes here: the feature costs nothing when it is off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from verst.engine.sampling import RowPenalties, SamplingParams

_FIRST_CAPACITY = 8  # slots, the neutral one included; doubled when full


@dataclass
class StepPenalties:
    slots_B: torch.Tensor  # each row's slot (0: none)
    rows: RowPenalties


class PenaltySlots:
    def __init__(self, vocab: int, device: torch.device, eos_token_ids: Iterable[int] = ()) -> None:
        self.vocab = vocab
        self.device = device
        self.eos_token_ids = set(eos_token_ids)
        self.requests = 0  # penalized requests in the scheduler (admitted, not yet left)
        self._slot_of: dict[int, int] = {}  # id(owner) -> its slot, once it sampled
        self.capacity = 0
        self._free: list[int] = []
        self._features: dict[int, tuple[str, ...]] = {}  # held slot -> the features it uses
        self._users: Counter[str] = Counter()  # feature -> held slots that use it
        self.counts_S_V = torch.zeros((0, vocab), device=device)
        self.generated_S = torch.zeros(0, device=device)
        self.frequency_S = torch.zeros(0, device=device)
        self.presence_S = torch.zeros(0, device=device)
        self.repetition_S = torch.ones(0, device=device)
        self.min_new_S = torch.zeros(0, device=device)
        self.stops_S_V: torch.Tensor | None = None  # bool, made for the first min_new_tokens
        self.bias_S_V: torch.Tensor | None = None  # made for the first logit_bias

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, device: torch.device, eos_token_ids: Iterable[int]
    ) -> PenaltySlots:
        """Rows as wide as the LM head's output: the token ids the sampler can draw."""
        weight = getattr(model.get_output_embeddings(), "weight", None)
        vocab = int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)
        return cls(vocab, device, eos_token_ids)

    @property
    def held(self) -> int:
        return len(self._features)

    # --- requests -----------------------------------------------------------------------------

    def admit(self, params: SamplingParams) -> None:
        """A request enters the scheduler; ValueError for a bias on a token the model lacks."""
        outside = [t for t in params.logit_bias if t >= self.vocab]
        if outside:
            raise ValueError(
                f"logit_bias token id {outside[0]} is outside the vocabulary [0, {self.vocab})"
            )
        self.requests += params.penalized

    def leave(self, owner: object, params: SamplingParams) -> None:
        """A request (`owner`: the scheduler's record of it, one per request in flight) leaves
        the scheduler, finished or aborted: its slot is free again."""
        self.requests -= params.penalized
        slot = self._slot_of.pop(id(owner), 0)
        if slot:
            self.release(slot)

    def step(
        self, owners: Sequence[object], params: Sequence[SamplingParams]
    ) -> StepPenalties | None:
        """The penalty state of one sampling call's rows; None when no row has penalties
        (and no work at all while no penalized request is in the scheduler). A request claims
        its slot when it first samples: queued requests hold none."""
        if not self.requests:
            return None
        slots = [self._slot(owner, p) for owner, p in zip(owners, params, strict=True)]
        if not any(slots):
            return None
        slots_B = torch.tensor(slots, device=self.device)
        return StepPenalties(slots_B, self.gather(slots_B))

    def _slot(self, owner: object, params: SamplingParams) -> int:
        slot = self._slot_of.get(id(owner), 0)
        if not slot and params.penalized:
            stops = set(params.stop_token_ids) | (
                set() if params.ignore_eos else self.eos_token_ids
            )
            slot = self._slot_of[id(owner)] = self.claim(params, stops)
        return slot

    # --- slots --------------------------------------------------------------------------------

    def claim(self, params: SamplingParams, stop_ids: Iterable[int]) -> int:
        """A slot for a request about to sample its first token; `stop_ids` are the tokens that
        would end it (those `min_new_tokens` blocks)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.counts_S_V[slot].zero_()
        self.generated_S[slot] = 0
        self.frequency_S[slot] = params.frequency_penalty
        self.presence_S[slot] = params.presence_penalty
        self.repetition_S[slot] = params.repetition_penalty
        self.min_new_S[slot] = params.min_new_tokens
        if params.min_new_tokens and self.stops_S_V is None:
            self.stops_S_V = torch.zeros(
                (self.capacity, self.vocab), dtype=torch.bool, device=self.device
            )
        if self.stops_S_V is not None:
            self.stops_S_V[slot] = False
            ids = sorted({t for t in stop_ids if 0 <= t < self.vocab})
            if params.min_new_tokens and ids:
                self.stops_S_V[slot, ids] = True
        if params.logit_bias and self.bias_S_V is None:
            self.bias_S_V = torch.zeros((self.capacity, self.vocab), device=self.device)
        if self.bias_S_V is not None:
            self.bias_S_V[slot] = 0.0
            if params.logit_bias:
                tokens = list(params.logit_bias)
                values = torch.tensor([float(params.logit_bias[t]) for t in tokens])
                self.bias_S_V[slot, tokens] = values.to(self.device)
        features = _features(params)
        self._features[slot] = features
        self._users.update(features)
        return slot

    def release(self, slot: int) -> None:
        self._users.subtract(self._features.pop(slot))
        self._free.append(slot)

    def gather(self, slots_B: torch.Tensor) -> RowPenalties:
        """The state of each row (slot 0 for rows without penalties), only for the features
        some held slot uses."""
        counted = any(self._users[f] for f in ("frequency", "presence", "repetition"))
        pen = RowPenalties(counts_B_V=self.counts_S_V[slots_B] if counted else None)
        if self._users["frequency"]:
            pen.frequency_B = self.frequency_S[slots_B]
        if self._users["presence"]:
            pen.presence_B = self.presence_S[slots_B]
        if self._users["repetition"]:
            pen.repetition_B = self.repetition_S[slots_B]
        if self._users["min_new"] and self.stops_S_V is not None:
            short_B = self.generated_S[slots_B] < self.min_new_S[slots_B]
            pen.blocked_B_V = self.stops_S_V[slots_B] & short_B.unsqueeze(-1)
        if self._users["bias"] and self.bias_S_V is not None:
            pen.bias_B_V = self.bias_S_V[slots_B]
        return pen

    def record(self, slots_B: torch.Tensor, tokens_B: torch.Tensor) -> None:
        """Count each row's sampled token in its slot, on the device (the neutral slot adds 0)."""
        one_B = (slots_B > 0).float()
        self.counts_S_V.index_put_((slots_B, tokens_B), one_B, accumulate=True)
        self.generated_S.index_add_(0, slots_B, one_B)

    def _grow(self) -> None:
        old = self.capacity
        new = max(_FIRST_CAPACITY, 2 * old)

        def grown(t: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full((new, *t.shape[1:]), fill, dtype=t.dtype, device=self.device)
            out[:old] = t
            return out

        self.counts_S_V = grown(self.counts_S_V, 0.0)
        self.generated_S = grown(self.generated_S, 0.0)
        self.frequency_S = grown(self.frequency_S, 0.0)
        self.presence_S = grown(self.presence_S, 0.0)
        self.repetition_S = grown(self.repetition_S, 1.0)
        self.min_new_S = grown(self.min_new_S, 0.0)
        if self.stops_S_V is not None:
            self.stops_S_V = grown(self.stops_S_V, False)
        if self.bias_S_V is not None:
            self.bias_S_V = grown(self.bias_S_V, 0.0)
        self._free += range(new - 1, max(old, 1) - 1, -1)  # slot 0 stays neutral
        self.capacity = new


def _features(params: SamplingParams) -> tuple[str, ...]:
    used = {
        "frequency": params.frequency_penalty != 0,
        "presence": params.presence_penalty != 0,
        "repetition": params.repetition_penalty != 1.0,
        "min_new": params.min_new_tokens > 0,
        "bias": bool(params.logit_bias),
    }
    return tuple(name for name, on in used.items() if on)
