"""A request's output streamed as it is decoded (SGLang's `stream: true`).

Owns `IncrementalText`, the text of a growing list of token ids decoded a few tokens at a time:
a character whose bytes span several tokens is held back until it is whole, and so is a tail
of the text that may begin a stop string, so the text streamed is always a prefix of the final
text. And `StreamState`, what a streamed request has generated so far. The serving loop only
counts a request's tokens after each step (`poke`: is a chunk due?); the consumer, woken, pulls
the new tokens (`pull`, work in the new tokens only) and builds the chunk (`chunk`) on the event
loop while the next step runs, so no per-token work of a stream delays a step, and a slow client
coalesces steps rather than queue a chunk per step.
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
        self.ready = asyncio.Event()  # set when a chunk is due (and when the request ends)
        self.generated = 0  # output tokens the serving loop has seen (`poke`)
        self._taken = 0  # output tokens in the last chunk taken
        self._has_input = False  # the prompt's log-prob entries are in `logprobs`

    def poke(self, generated: int) -> None:
        """The request has `generated` output tokens after a step that did not end it (called
        by the serving loop between steps; a chunk shows no more): a chunk is due at the first
        token and then every `stream_interval` tokens."""
        self.generated = generated
        if generated > self._taken and (
            self._taken == 0 or generated - self._taken >= self.opts.stream_interval
        ):
            self.ready.set()

    def pull(self, new: GenerateOutput) -> None:
        """Add the tokens past `self.ids` (`Running.output_since(len(self.ids), ...,
        with_input=self.wants_input)`). The prompt's log-prob entries come whole with the first
        pull that has them all (a request retracted and prefilled again scores its prompt
        anew)."""
        if not new.output_ids:
            return
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
            take_input = not self._has_input and self._input_whole(new)
            for key, values in meta.items():
                if not key.startswith("input_"):
                    self.logprobs.setdefault(key, []).extend(values)
                elif take_input:
                    self.logprobs[key] = values
            self._has_input = self._has_input or take_input

    @property
    def wants_input(self) -> bool:
        """The prompt's log-prob entries are asked for and not in yet (`output_since`)."""
        return self.request.return_logprob and not self._has_input

    def _input_whole(self, new: GenerateOutput) -> bool:
        """`new` holds every prompt entry the request asks for (one per position from
        `logprob_start_len`; with -1 the one entry needs no scoring)."""
        start = self.request.logprob_start_len
        if start < 0:
            return True
        want = len(self.request.input_ids) - start
        lists = [new.input_token_logprobs]
        if self.request.top_logprobs_num > 0:
            lists.append(new.input_top_logprobs)
        if self.request.token_ids_logprob is not None:
            lists.append(new.input_token_ids_logprobs)
        return all(len(values) == want for values in lists)

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
