"""What the scheduler holds of one request while it runs (`Running`): its tokens, KV pages,
cache match, log-probs and versions so far, its adapter slot and its timing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from verst.engine.logprob_extras import LogprobRecord
from verst.engine.radix_cache import PrefixMatch
from verst.engine.requests import GenerateRequest


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
