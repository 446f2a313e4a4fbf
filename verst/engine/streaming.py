"""A request's output streamed as it is decoded (SGLang's `stream: true`).

Owns `IncrementalText`, the text of a growing list of token ids decoded a few tokens at a time:
a character whose bytes span several tokens is held back until it is whole, and so is a tail
of the text that may begin a stop string, so the text streamed is always a prefix of the final
text. And `StreamState`, what a streamed request has generated so far: the serving loop pulls
each step's new tokens into it (`pull`, work in the new tokens only), and the consumer builds a
chunk from it when it is ready for one (`chunk`), so a slow client coalesces steps rather than
queue a chunk per step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from verst.engine.requests import GenerateOutput, GenerateRequest
from verst.engine.results import DetokenizeParams, GenerateResult, ResultShaper

REPLACEMENT = "\ufffd"  # what a decoder makes of the first bytes of an unfinished character


class IncrementalText:
    """The text of a growing list of token ids, decoded over a window of the last few."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(stops)
        self.text = ""  # the text of ids[:_read]
        # ids[_prefix:_read] are decoded again as the context of the new ids: a tokenizer's
        # text for a token can depend on the one before it (a leading space, a merged byte)
        self._prefix = 0
        self._read = 0

    def update(self, ids: list[int]) -> str:
        """The text of `ids` (the ids of the last call and more) that is safe to send."""
        if len(ids) > self._read:
            context = self.decode(ids[self._prefix : self._read])
            window = self.decode(ids[self._prefix :])
            if len(window) > len(context) and not window.endswith(REPLACEMENT):
                self.text += window[len(context) :]
                self._prefix, self._read = self._read, len(ids)
        return self.text[: len(self.text) - self._held()]

    def _held(self) -> int:
        """Characters at the end of the text that begin a stop string (the request may end
        there, and the final text is cut before the stop)."""
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return held


class StreamState:
    """A streamed request's output so far, in SGLang's `/generate` chunk shape."""

    def __init__(
        self, request: GenerateRequest, opts: DetokenizeParams, shaper: ResultShaper
    ) -> None:
        self.request = request
        self.opts = opts
        self.shaper = shaper
        self.ids: list[int] = []
        self.cached_tokens = 0
        self.spans: list[dict[str, Any]] = []  # meta_info.weight_versions so far
        self.logprobs: dict[str, list[Any]] = {}  # meta_info's log-prob lists so far
        self.text = IncrementalText(lambda ids: shaper.decode(ids, opts), opts.stop)
        self.ready = asyncio.Event()  # set when a chunk is due
        self._taken = 0  # output tokens in the last chunk taken

    def pull(self, new: GenerateOutput) -> None:
        """Add a step's new tokens (`Running.output_since(len(self.ids), ...)`); a chunk is due
        at the first token and then every `stream_interval` tokens."""
        if not new.output_ids:
            return
        first = not self.ids
        self.ids += new.output_ids
        self.cached_tokens = new.cached_tokens
        for version in map(str, new.token_weight_versions):
            if self.spans and self.spans[-1]["version"] == version:
                self.spans[-1]["end"] += 1
            else:
                end = self.spans[-1]["end"] if self.spans else 0
                self.spans.append({"version": version, "start": end, "end": end + 1})
        if self.request.return_logprob:
            with_text = self.opts.return_text_in_logprobs
            meta = self.shaper.logprob_meta(self.request, new, with_text)
            del meta["output_token_logprobs_length"]
            for key, values in meta.items():
                if not key.startswith("input_"):
                    self.logprobs.setdefault(key, []).extend(values)
                elif first:  # the prompt's entries come whole with the first tokens
                    self.logprobs[key] = values
        if self._taken == 0 or len(self.ids) - self._taken >= self.opts.stream_interval:
            self.ready.set()

    def chunk(self, version: str) -> GenerateResult:
        """The output so far as SGLang's cumulative chunk (`finish_reason` null)."""
        self.ready.clear()
        self._taken = len(self.ids)
        meta: dict[str, Any] = {
            "id": self.request.rid,
            "finish_reason": None,
            "prompt_tokens": len(self.request.input_ids),
            "completion_tokens": len(self.ids),
            "cached_tokens": self.cached_tokens,
            "reasoning_tokens": 0,
            "weight_version": version,
            "weight_versions": [dict(span) for span in self.spans],
        }
        if self.request.return_logprob:
            meta.update({key: list(values) for key, values in self.logprobs.items()})
            meta["output_token_logprobs_length"] = len(self.ids)
        text = self.text.update(self.ids)
        return GenerateResult(text=text, output_ids=list(self.ids), meta_info=meta)
