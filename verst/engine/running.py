"""What the scheduler holds of one request while it runs (`Running`): its tokens, KV pages,
cache match, log-probs and versions so far, its adapter slot and its timing; and its output so
far, for streaming (`Running.output_since`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from verst.engine.logprob_extras import LogprobRecord
from verst.engine.radix_cache import PrefixMatch
from verst.engine.requests import GenerateOutput, GenerateRequest


@dataclass(eq=False)  # identity: `in` / `remove` on the running list stay O(1) per comparison
class Running:
    """One request inside the scheduler."""

    request: GenerateRequest
    tokens: list[int]  # prompt + output so far
    prompt_length: int
    output_logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # KV of tokens[:computed]
    match: PrefixMatch | None = None  # the locked cache prefix at the front of `pages`
    computed: int = 0
    cached_tokens: int = 0
    retractions: int = 0
    generator: torch.Generator | None = None  # the request's own, when it has a seed
    input_logprobs: list[float | None] = field(default_factory=list)
    token_versions: list[int | str] = field(default_factory=list)
    leader: Running | None = None  # a running request prefilling this very prompt
    adapter: int | None = None  # its LoRA adapter's slot (`ModelRunner.adapters`); None: base
    cache_offset: int = 0  # added to token ids in prefix-cache keys: an adapter's KV is its own
    first_token_s: float | None = None  # time.perf_counter() when its first token was sampled
    matched_stop: int | str | None = None  # the stop token, string or regex that ended it
    extras: LogprobRecord | None = None  # its top-k / chosen-id log-probs, when it asks for them
    grammar: Any = None  # its grammar's matcher (`verst.engine.grammar`), when it has one

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def output_since(
        self,
        start: int,
        weight_version: int | str,
        *,
        end: int | None = None,
        with_input: bool = False,
    ) -> GenerateOutput:
        """The output tokens from index `start` on (to `end`, when given), with their log-probs
        and versions, for streaming, with no bookkeeping (the request runs on), and
        (`with_input`) the prompt's log-probs so far; `finish_reason` is "" (not finished).
        Safe while a step runs on another thread: the step appends a token's log-probs and
        version before the token, and the token count is read first, so every list here covers
        the same tokens."""
        req, n, extras = self.request, len(self.tokens) - self.prompt_length, self.extras
        n = n if end is None else min(n, end)
        first = with_input
        top = extras.output_top[start:n] if extras is not None else []
        chosen = extras.output_chosen[start:n] if extras is not None else []
        input_top = list(extras.input_top) if extras is not None and first else []
        input_chosen = list(extras.input_chosen) if extras is not None and first else []
        return GenerateOutput(
            rid=req.rid,
            output_ids=self.tokens[self.prompt_length + start : self.prompt_length + n],
            output_token_logprobs=self.output_logprobs[start:n] if req.return_logprob else [],
            finish_reason="",
            prompt_tokens=self.prompt_length,
            completion_tokens=n,
            weight_version=weight_version,
            cached_tokens=self.cached_tokens,
            input_token_logprobs=list(self.input_logprobs) if first else [],
            token_weight_versions=self.token_versions[start:n],
            first_token_s=self.first_token_s,
            output_top_logprobs=top,
            output_token_ids_logprobs=chosen,
            input_top_logprobs=input_top,
            input_token_ids_logprobs=input_chosen,
        )
