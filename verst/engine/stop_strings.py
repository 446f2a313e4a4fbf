"""Stop strings and stop regexes (SGLang's `stop`, `stop_regex`) over a request's output text.

Owns `StopMatcher`, built per request from its stops and a decode function. The scheduler calls
`check(output_ids)` after every sampled token, so a request ends at the token that completes a
stop rather than running on to `max_new_tokens`. A step decodes only the tail of the output: as
many tokens as the longest stop string (or the longest match a bounded regex can make) has
characters, plus two, as SGLang does; a regex with no bound (`\\d+`) decodes the whole output. A
tail hit is confirmed on the whole text, so a request never stops on a match the text does not
hold; a match the tail misses (a token that decodes to no characters) is still found when the
result is shaped (`verst.engine.results`), which cuts the output at the shortest prefix whose
text holds a stop, and `first(text)` places the cut.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

MAX_STOPS = 32  # SGLang's limits on `stop` and `stop_regex`
MAX_REGEX_BYTES = 256
_TAIL_SLACK = 2  # tokens beyond the longest match: the boundary token and one more
_UNBOUNDED = 1 << 16  # a regex that can match more characters than this is checked whole

try:  # the regex parser behind `re` (Python 3.11+); `sre_parse` before
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]


def regex_width(pattern: str) -> int | None:
    """The most characters one match of `pattern` can span; None when it has no bound."""
    try:
        widest = int(_sre_parse.parse(pattern).getwidth()[1])
    except Exception:  # an internal parser we only use for a bound: no bound then
        return None
    return widest if widest < _UNBOUNDED else None


def compile_stop_regex(pattern: str) -> re.Pattern[str]:
    """`pattern` compiled; ValueError naming it when it is too long or not a regex."""
    if len(pattern.encode()) > MAX_REGEX_BYTES:
        raise ValueError(f"stop_regex {pattern[:40]!r}... is longer than {MAX_REGEX_BYTES} bytes")
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regex: {error}") from error


class StopMatcher:
    def __init__(
        self,
        strings: Sequence[str],
        regexes: Sequence[str],
        decode: Callable[[list[int]], str],
    ) -> None:
        self.strings = tuple(strings)
        self.patterns = tuple(compile_stop_regex(p) for p in regexes)
        self.decode = decode
        widths = [len(s) for s in self.strings] + [regex_width(p) for p in regexes]
        # tokens decoded per step; None: the whole output
        self.window = None if None in widths else max(widths, default=0) + _TAIL_SLACK

    def check(self, output_ids: list[int]) -> str | None:
        """The stop the output's text holds now (a string, or a regex's pattern), or None."""
        tail = output_ids if self.window is None else output_ids[-self.window :]
        hit = self.first(self.decode(tail))
        if hit is not None and len(tail) < len(output_ids):
            hit = self.first(self.decode(output_ids))  # a tail's text can differ at its edge
        return None if hit is None else hit[2]

    def first(self, text: str) -> tuple[int, int, str] | None:
        """The earliest stop in `text`: (start, end, the string or pattern), or None."""
        hits = [(text.find(s), len(s), s) for s in self.strings if s in text]
        hits = [(start, start + n, s) for start, n, s in hits]
        for pattern in self.patterns:
            match = pattern.search(text)
            if match is not None:
                hits.append((match.start(), match.end(), pattern.pattern))
        return min(hits, key=lambda h: (h[0], h[1])) if hits else None
