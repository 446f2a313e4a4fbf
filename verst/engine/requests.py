"""The engine's request and output records, with SGLang's field names.

Owns `GenerateRequest` (one prompt and its sampling settings), `GenerateOutput` (the response
ids, their log-probs and the weight versions that produced them) and the finish reasons. A leaf
module: the engines, the fleet, the rollout and the plug-in contracts (`verst.plugins`) all
speak these records without importing an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from uuid import uuid4

import torch

from verst.engine.sampling import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: SamplingParams
    rid: str = field(default_factory=lambda: uuid4().hex)
    return_logprob: bool = True
    logprob_start_len: int = -1  # >= 0: also score the prompt from this position (no prefix cache)
    lora_path: str | None = None  # the name of a LoRA adapter the engine holds; None: the base
    # Called with the output ids after each sampled token: the stop string or regex pattern
    # the text now holds, ending the request (finish "stop"), or None. The serving layer
    # builds it from the request's stop strings (`verst.engine.stop_strings`).
    stop_check: Callable[[list[int]], str | None] | None = field(default=None, repr=False)
    # with return_logprob: also the k likeliest tokens' log-probs at every scored position
    top_logprobs_num: int = 0
    # with return_logprob: also these token ids' log-probs at every scored position
    token_ids_logprob: list[int] | None = None
    # MoE models: also the experts every token was routed to, in every layer (SGLang's field)
    return_routed_experts: bool = False

    @property
    def wants_logprob_extras(self) -> bool:
        """Top-k or chosen-id log-probs are asked for (computed only for such requests)."""
        return self.return_logprob and (
            self.top_logprobs_num > 0 or self.token_ids_logprob is not None
        )


@dataclass
class GenerateOutput:
    rid: str
    output_ids: list[int]
    output_token_logprobs: list[float]  # one per output id; empty if return_logprob is False
    finish_reason: str  # "stop" (EOS / stop token, included in output_ids) or "length"
    prompt_tokens: int
    completion_tokens: int
    weight_version: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # SGLang's shape: one entry per prompt position from logprob_start_len, the first None
    input_token_logprobs: list[float | None] = field(default_factory=list)
    # the weight version that produced each output token (a request can span an update)
    token_weight_versions: list[int | str] = field(default_factory=list)
    # time.perf_counter() in the engine's process when the first output token was sampled
    first_token_s: float | None = None
    # finish "stop": the stop token id (the last output id), or the stop string / regex
    # pattern `stop_check` matched; None when the reason is not "stop"
    matched_stop: int | str | None = None
    # top_logprobs_num > 0: per output token its k likeliest (logprob, token id), likeliest
    # first; per scored prompt position likewise (the first None, as input_token_logprobs)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    # token_ids_logprob: per output token (and scored prompt position) each asked id's log-prob
    output_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[float] | None] = field(default_factory=list)
    # return_routed_experts: int32 [prompt + output − 1, layers, top_k] (SGLang's shape), the
    # experts of every fed position in every layer (-1: a layer without experts); else None
    routed_experts: torch.Tensor | None = None

    def first(self, n: int) -> GenerateOutput:
        """This output cut to its first n output tokens (every per-token list with them)."""
        return replace(
            self,
            output_ids=self.output_ids[:n],
            output_token_logprobs=self.output_token_logprobs[:n],
            completion_tokens=min(self.completion_tokens, n),
            token_weight_versions=self.token_weight_versions[:n],
            output_top_logprobs=self.output_top_logprobs[:n],
            output_token_ids_logprobs=self.output_token_ids_logprobs[:n],
            routed_experts=None
            if self.routed_experts is None
            else self.routed_experts[: max(self.prompt_tokens + n - 1, 0)],
        )


def finish_reason(
    request: GenerateRequest, output_ids: list[int], eos_token_ids: list[int]
) -> tuple[str | None, int | str | None]:
    """Whether a request ends with the token it just sampled, and what it matched: a stop token
    (EOS unless `ignore_eos`, or one of `stop_token_ids`), a stop string or regex (its
    `stop_check`), or its length limit ("length", None); (None, None) while it goes on."""
    params, token = request.sampling_params, output_ids[-1]
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return FINISH_STOP, token
    matched = request.stop_check(output_ids) if request.stop_check is not None else None
    if matched is not None:
        return FINISH_STOP, matched
    return (FINISH_LENGTH if len(output_ids) >= params.max_new_tokens else None), None
