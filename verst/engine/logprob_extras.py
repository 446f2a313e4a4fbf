"""The log-probs a request asks for besides its sampled token's: the k likeliest tokens
(`top_logprobs_num`) and chosen token ids (`token_ids_logprob`), at output steps and at
scored prompt positions.

Promise: these are the very quantity the sampler returns (`verst.engine.sampling`):
`log_softmax(z / T)` over the full vocabulary in float32, z the logits after the request's
penalties and logit bias (and its grammar's mask), T = 1 for greedy rows; top-k
entries come likeliest first (`torch.topk`). They are computed in one batched pass over the rows
that ask (one top-k and one gather for all of them), so a step where no request asks costs
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from verst.engine.requests import GenerateRequest
from verst.engine.sampling import SamplingParams

TopEntries = list[tuple[float, int]]  # (logprob, token id), likeliest first


def scaled_logprobs(logits_B_V: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """`log_softmax(logits / T)` per row in float32, computed as the sampler does (a greedy row,
    T <= 0, divides by 1)."""
    temp_B = torch.tensor(
        [t if t > 0 else 1.0 for t in temperatures], device=logits_B_V.device
    ).float()
    return torch.log_softmax(logits_B_V.float() / temp_B.unsqueeze(-1), dim=-1)


def logprob_extras(
    logprobs_B_V: torch.Tensor,
    top_ks: Sequence[int],
    token_ids: Sequence[Sequence[int] | None],
) -> tuple[list[TopEntries], list[list[float]]]:
    """Per row: its `top_ks[i]` likeliest (logprob, id) and the log-probs of `token_ids[i]`, in
    the order asked (empty lists where a row asks for none)."""
    rows = logprobs_B_V.shape[0]
    top: list[TopEntries] = [[] for _ in range(rows)]
    k = min(max(top_ks, default=0), logprobs_B_V.shape[-1])
    if k > 0:
        values_B_K, ids_B_K = logprobs_B_V.topk(k, dim=-1)
        top = [
            list(zip(values[:n], ids[:n], strict=True))
            for values, ids, n in zip(values_B_K.tolist(), ids_B_K.tolist(), top_ks, strict=True)
        ]
    chosen: list[list[float]] = [[] for _ in range(rows)]
    width = max((len(ids) for ids in token_ids if ids), default=0)
    if width:
        index_B_W = torch.tensor(
            [list(ids or ()) + [0] * (width - len(ids or ())) for ids in token_ids],
            device=logprobs_B_V.device,
        )
        gathered = logprobs_B_V.gather(-1, index_B_W).tolist()
        chosen = [row[: len(ids or ())] for row, ids in zip(gathered, token_ids, strict=True)]
    return top, chosen


@dataclass
class LogprobRecord:
    """A request's extra log-probs so far, and what it asks for."""

    top_k: int
    token_ids: list[int] | None
    output_top: list[TopEntries] = field(default_factory=list)
    output_chosen: list[list[float]] = field(default_factory=list)
    input_top: list[TopEntries | None] = field(default_factory=list)
    input_chosen: list[list[float] | None] = field(default_factory=list)

    @classmethod
    def for_request(cls, request: GenerateRequest) -> LogprobRecord | None:
        """The record a request needs (None when it asks for no extras); ValueError for a bad
        `logprob_start_len`, `top_logprobs_num` or `token_ids_logprob`."""
        if request.logprob_start_len >= len(request.input_ids):
            raise ValueError(
                f"logprob_start_len {request.logprob_start_len} must be below the prompt "
                f"length {len(request.input_ids)} (rid {request.rid})"
            )
        k, ids = request.top_logprobs_num, request.token_ids_logprob
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
            raise ValueError(f"top_logprobs_num must be an int >= 0, got {k!r}")
        if ids is not None and not all(_is_token(t) for t in ids):
            raise ValueError(f"token_ids_logprob must be a list of token ids, got {ids!r}")
        if not request.wants_logprob_extras:
            return None
        return cls(top_k=k, token_ids=None if ids is None else list(ids))

    def output_fields(self) -> dict[str, list]:
        """The record as `GenerateOutput` fields (copies: the record goes on growing)."""
        return {
            "output_top_logprobs": list(self.output_top),
            "output_token_ids_logprobs": list(self.output_chosen),
            "input_top_logprobs": list(self.input_top),
            "input_token_ids_logprobs": list(self.input_chosen),
        }


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def record_step(
    records: Sequence[LogprobRecord | None],
    params: Sequence[SamplingParams],
    logits_B_V: torch.Tensor,
) -> None:
    """Append this step's extras to the record of every row that asks (row i: `records[i]`,
    sampled under `params[i]` from `logits_B_V[i]`); a step where none asks runs no tensor op."""
    asking = [i for i, record in enumerate(records) if record is not None]
    if not asking:
        return
    rows_A_V = logits_B_V if len(asking) == len(records) else logits_B_V[asking]
    logprobs_A_V = scaled_logprobs(rows_A_V, [params[i].temperature for i in asking])
    chosen = [records[i] for i in asking]
    top, picked = logprob_extras(
        logprobs_A_V, [r.top_k for r in chosen], [r.token_ids for r in chosen]
    )
    for record, entries, values in zip(chosen, top, picked, strict=True):
        record.output_top.append(entries)
        record.output_chosen.append(values)


def score_prompt(
    logits_T_V: torch.Tensor,
    targets: list[int],
    temperature: float,
    record: LogprobRecord | None,
    first_chunk: bool,
) -> list[float]:
    """The log-probs of `targets`, the prompt tokens these logits predict (row t predicts
    `targets[t]`; targets past the last row wait for the next chunk), with the record's extras
    for the same positions. The first chunk starts the
    record's lists with None, as SGLang's input log-probs start (the first position has no
    prediction)."""
    if record is not None and first_chunk:
        record.input_top, record.input_chosen = [None], [None]
    targets = targets[: logits_T_V.shape[0]]
    if not targets:
        return []
    logprobs_T_V = scaled_logprobs(logits_T_V[: len(targets)], [temperature] * len(targets))
    index_T_1 = torch.tensor(targets, device=logits_T_V.device).unsqueeze(-1)
    scored = logprobs_T_V.gather(-1, index_T_1).squeeze(-1).tolist()
    if record is not None:
        n = len(targets)
        top, picked = logprob_extras(logprobs_T_V, [record.top_k] * n, [record.token_ids] * n)
        record.input_top += top
        record.input_chosen += picked
    return scored
