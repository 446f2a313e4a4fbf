"""Shaping scheduler outputs into SGLang's `/generate` items: text, stop strings, meta_info.

Owns `DetokenizeParams` (the sampling keys that act after sampling: stop strings, special
tokens), `GenerateResult` (`text`, `output_ids`, `meta_info`) and `ResultShaper`, which turns a
`GenerateOutput` into exactly the fields and shapes SGLang answers with.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from verst.engine.requests import FINISH_LENGTH, FINISH_STOP, GenerateOutput, GenerateRequest
from verst.engine.stop_strings import StopMatcher
from verst.models.moe import encode_routed_experts


@dataclass
class DetokenizeParams:
    """How output ids become `text` (SGLang's sampling keys that act after sampling)."""

    stop: Sequence[str] = ()
    stop_regex: Sequence[str] = ()
    no_stop_trim: bool = False
    stream_interval: int = 1  # a streamed request sends a chunk every this many tokens
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_text_in_logprobs: bool = False


@dataclass
class GenerateResult:
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info}


def version_spans(versions: Sequence[int | str]) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions`: runs of output tokens made by one version, as
    `{"version": str, "start": i, "end": j}` over token indices [i, j)."""
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": str(version), "start": index, "end": index + 1})
    return spans


def _backend_decoder(tokenizer: Any) -> Any:
    """The Rust tokenizer whose `decode` is exactly this HF fast tokenizer's (its `_decode`
    is the base class's and cleans up no spaces), or None. Streaming decodes every few tokens,
    and HF's wrapper around the Rust call costs twice the call itself."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    if type(tokenizer)._decode is not PreTrainedTokenizerFast._decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return getattr(tokenizer, "_tokenizer", None)


class ResultShaper:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # one token's text, for return_text_in_logprobs
        self._backend = _backend_decoder(tokenizer)

    def decode(self, ids: list[int], opts: DetokenizeParams) -> str:
        if self._backend is not None:  # fast tokenizers ignore spaces_between_special_tokens
            return self._backend.decode(ids, skip_special_tokens=opts.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=opts.skip_special_tokens,
            spaces_between_special_tokens=opts.spaces_between_special_tokens,
        )

    def stop_matcher(self, opts: DetokenizeParams) -> StopMatcher | None:
        """The request's stop strings and regexes over its text as `opts` decodes it; None
        when it has none."""
        if not opts.stop and not opts.stop_regex:
            return None
        return StopMatcher(opts.stop, opts.stop_regex, lambda ids: self.decode(ids, opts))

    def finished(
        self,
        request: GenerateRequest,
        opts: DetokenizeParams,
        submitted_s: float,
        out: GenerateOutput,
        version: str,
        abort_message: str = "the request does not fit in the KV cache",
    ) -> GenerateResult:
        """A scheduler output as SGLang's `/generate` item. An abort finish says
        `abort_message`: by default the scheduler's own reason (user aborts pass theirs)."""
        ids = out.output_ids
        finish: dict[str, Any]
        text_ids = ids
        by_token = out.finish_reason == FINISH_STOP and not isinstance(out.matched_stop, str)
        if by_token:
            finish = {"type": "stop", "matched": ids[-1]}
            if not opts.no_stop_trim:
                text_ids = ids[:-1]
        elif out.finish_reason == FINISH_STOP:  # a stop string or regex the scheduler matched
            finish = {"type": "stop", "matched": out.matched_stop}
        elif out.finish_reason == FINISH_LENGTH:
            finish = {"type": "length", "length": len(ids)}
        else:
            finish = {"type": "abort", "message": abort_message, "status_code": None}
        text = self.decode(text_ids, opts)
        matcher = self.stop_matcher(opts)
        if matcher is not None and matcher.first(text) is not None:
            k, text, matched = self._cut_at_stop(text_ids, opts, matcher)
            out = out.first(k)
            ids = out.output_ids
            finish = {"type": "stop", "matched": matched}
        meta: dict[str, Any] = {
            "id": out.rid,
            "finish_reason": finish,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": out.cached_tokens,
            "reasoning_tokens": 0,
            "weight_version": version,
            "weight_versions": version_spans(out.token_weight_versions[: len(ids)]),
            "e2e_latency": time.perf_counter() - submitted_s,
        }
        if request.return_logprob:
            meta.update(self.logprob_meta(request, out, opts.return_text_in_logprobs))
        if request.return_routed_experts and out.routed_experts is not None:
            meta["routed_experts"] = encode_routed_experts(out.routed_experts)
        return GenerateResult(text=text, output_ids=list(ids), meta_info=meta)

    def logprob_meta(
        self, request: GenerateRequest, out: GenerateOutput, with_text: bool
    ) -> dict[str, Any]:
        """SGLang's log-prob keys: `[logprob, token_id, text]` triples per position (text null
        unless `with_text`). Input lists cover the prompt from `logprob_start_len` (its last
        token when -1, as SGLang) and start with a null log-prob: that position is predicted
        by nothing the request scored."""
        start = request.logprob_start_len
        if start < 0:
            start = len(request.input_ids) - 1
            input_lps: list[float | None] = [None]
            input_top: list[Any] = [None]
            input_chosen: list[Any] = [None]
        else:
            input_lps, input_top = out.input_token_logprobs, out.input_top_logprobs
            input_chosen = out.input_token_ids_logprobs
        meta: dict[str, Any] = {
            # an abort during the prompt's prefill has scored only part of it
            "input_token_logprobs": self._triples(
                input_lps, request.input_ids[start : start + len(input_lps)], with_text
            ),
            "output_token_logprobs": self._triples(
                out.output_token_logprobs, out.output_ids, with_text
            ),
            "output_token_logprobs_length": len(out.output_ids),
        }
        if request.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [self._top(e, with_text) for e in input_top]
            meta["output_top_logprobs"] = [self._top(e, with_text) for e in out.output_top_logprobs]
        asked = request.token_ids_logprob
        if asked is not None:
            meta["input_token_ids_logprobs"] = [
                self._chosen(e, asked, with_text) for e in input_chosen
            ]
            meta["output_token_ids_logprobs"] = [
                self._chosen(e, asked, with_text) for e in out.output_token_ids_logprobs
            ]
        return meta

    def token_text(self, token_id: int) -> str:
        """One token decoded alone (SGLang's text in log-prob triples)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _triples(
        self, logprobs: Sequence[float | None], ids: Sequence[int], with_text: bool
    ) -> list[list[Any]]:
        return [
            [lp, tid, self.token_text(tid) if with_text else None]
            for lp, tid in zip(logprobs, ids, strict=True)
        ]

    def _top(self, entries: Sequence[tuple[float, int]] | None, with_text: bool) -> Any:
        """One position's top-k triples; null where nothing was scored (SGLang's shape)."""
        if not entries:
            return None
        return self._triples([lp for lp, _ in entries], [tid for _, tid in entries], with_text)

    def _chosen(self, values: Sequence[float] | None, asked: list[int], with_text: bool) -> Any:
        return self._triples(values, asked, with_text) if values else None

    def _cut_at_stop(
        self, ids: list[int], opts: DetokenizeParams, matcher: StopMatcher
    ) -> tuple[int, str, str]:
        """The shortest prefix of `ids` (whose whole text holds a stop) whose text holds a stop:
        (length, text, matched).

        "Contains a stop string" is monotone in the prefix length, so a binary search costs
        O(log n) decodes rather than one per token; a regex that is not monotone (an anchor, a
        lookahead) whose search ends on a prefix without a match is cut on the whole of `ids`.
        """
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if matcher.first(self.decode(ids[:mid], opts)) is not None:
                hi = mid
            else:
                lo = mid + 1
        text = self.decode(ids[:lo], opts)
        hit = matcher.first(text)
        if hit is None:
            lo, text = len(ids), self.decode(ids, opts)
            hit = matcher.first(text)
        assert hit is not None  # the caller found a stop in the text of `ids`
        start, end, matched = hit
        return lo, text[: end if opts.no_stop_trim else start], matched

    def aborted(
        self,
        request: GenerateRequest,
        opts: DetokenizeParams,
        message: str,
        version: str,
        submitted_s: float,
    ) -> GenerateResult:
        """A request answered with an abort before it produced anything."""
        nothing = GenerateOutput(
            rid=request.rid,
            output_ids=[],
            output_token_logprobs=[],
            finish_reason="abort",
            prompt_tokens=len(request.input_ids),
            completion_tokens=0,
            weight_version=0,
        )
        return self.finished(request, opts, submitted_s, nothing, version, message)
