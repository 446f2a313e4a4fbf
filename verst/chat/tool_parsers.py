"""Tool-call parsers, one per format, incremental: feed text as it is decoded, get the normal
content released so far and the tool calls completed so far.

Each format marks a call (or, for DeepSeek-V3, a section of calls) with a start string; the
parser holds text back from the moment the start (or a prefix of it, at the end of what it has)
appears until the call's end, then either turns it into OpenAI tool calls or, when it is not a
well-formed call, releases it as content unchanged (so a malformed call is never lost).
`finish()` releases whatever is still held. Calls come out in OpenAI's shape: `id`,
`type: "function"`, `function: {name, arguments}` with the arguments as a JSON string.

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`
- `glm4` (GLM-4.5, 4.6): `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n`
  ... `</tool_call>`
- `deepseek_v3`: a `<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>` section of
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}\\n```<｜tool▁call▁end｜>` calls
- `mistral`: `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]` (a space after the marker too)
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

ToolCall = dict[str, Any]


@dataclass
class ParsedDelta:
    """What one `feed` (or `finish`) released: content text, and the calls it completed, the
    first of which is the parser's call number `first_index` (for streamed `tool_calls[i]`)."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    first_index: int = 0


def make_call(name: str, arguments: Any) -> ToolCall:
    """An OpenAI tool call with a fresh id; arguments that are not a string are JSON-encoded."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _partial_start(text: str, start: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `start`."""
    for k in range(min(len(start) - 1, len(text)), 0, -1):
        if text.endswith(start[:k]):
            return k
    return 0


class ToolCallParser(ABC):
    """The incremental parser; a format fills in `start`, `markers`, `_end` and `_calls`."""

    start = ""
    markers: tuple[str, ...] = ()  # every string of the format the parser must see

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self._held = ""
        self._in_call = False
        self.num_calls = 0

    @abstractmethod
    def _end(self, held: str) -> int | None:
        """Where the call that `held` starts with ends (None: not yet)."""

    @abstractmethod
    def _calls(self, raw: str) -> list[ToolCall] | None:
        """The calls in one raw call text (start to end), or None when it is malformed."""

    def feed(self, text: str) -> ParsedDelta:
        delta = ParsedDelta(first_index=self.num_calls)
        self._held += text
        while self._held:
            if not self._in_call:
                at = self._held.find(self.start)
                if at < 0:
                    keep = _partial_start(self._held, self.start)
                    cut = len(self._held) - keep
                    delta.content += self._held[:cut]
                    self._held = self._held[cut:]
                    break
                delta.content += self._held[:at]
                self._held, self._in_call = self._held[at:], True
            end = self._end(self._held)
            if end is None:
                break
            raw, self._held, self._in_call = self._held[:end], self._held[end:], False
            calls = self._calls(raw)
            if calls is None:
                delta.content += raw
            else:
                delta.calls += calls
        self.num_calls += len(delta.calls)
        return delta

    def finish(self) -> ParsedDelta:
        """The end of the text: what is still held is content (an unfinished call included)."""
        delta = ParsedDelta(content=self._held, first_index=self.num_calls)
        self._held, self._in_call = "", False
        return delta

    def _parameter_types(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            fn = tool.get("function", tool) if isinstance(tool, dict) else {}
            if isinstance(fn, dict) and fn.get("name") == name:
                params = fn.get("parameters") or {}
                props = params.get("properties") if isinstance(params, dict) else None
                return props if isinstance(props, dict) else {}
        return {}


def _named_json_call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(args_key, obj.get("parameters", {}))
    return make_call(obj["name"], arguments)


class HermesParser(ToolCallParser):
    start, stop = "<tool_call>", "</tool_call>"
    markers = (start, stop)

    def _end(self, held: str) -> int | None:
        at = held.find(self.stop)
        return None if at < 0 else at + len(self.stop)

    def _calls(self, raw: str) -> list[ToolCall] | None:
        try:
            call = _named_json_call(json.loads(raw[len(self.start) : -len(self.stop)]))
        except ValueError:
            return None
        return None if call is None else [call]


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm4Parser(HermesParser):
    """GLM-4.5's calls: the name, then key/value pairs. A value is JSON unless the tool's schema
    says the parameter is a string (the template writes strings raw, the rest as JSON)."""

    markers = HermesParser.markers + ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def _calls(self, raw: str) -> list[ToolCall] | None:
        body = raw[len(self.start) : -len(self.stop)]
        name, _, rest = body.partition("\n")
        name = name.strip()
        if not name or _GLM_ARG.sub("", rest).strip():
            return None
        types = self._parameter_types(name)
        arguments: dict[str, Any] = {}
        for key, value in _GLM_ARG.findall(rest):
            schema = types.get(key.strip())
            if isinstance(schema, dict) and schema.get("type") == "string":
                arguments[key.strip()] = value
                continue
            try:
                arguments[key.strip()] = json.loads(value)
            except ValueError:
                arguments[key.strip()] = value
        return [make_call(name, arguments)]


_DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>(.+?)\n```json\n(.*?)\n```<｜tool▁call▁end｜>",
    re.DOTALL,
)


class DeepSeekV3Parser(HermesParser):
    """DeepSeek-V3's section of calls, released when the section closes."""

    start, stop = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    markers = (start, stop, "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")

    def _calls(self, raw: str) -> list[ToolCall] | None:
        body = raw[len(self.start) : -len(self.stop)]
        if _DS_CALL.sub("", body).strip():
            return None
        calls = []
        for kind, name, arguments in _DS_CALL.findall(body):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                return None
            if kind != "function" or not isinstance(parsed, dict):
                return None
            calls.append(make_call(name.strip(), parsed))
        return calls or None


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS]` then a JSON array of calls: the call ends where the array does."""

    start = "[TOOL_CALLS]"
    markers = (start,)
    _decoder = json.JSONDecoder()

    def _end(self, held: str) -> int | None:
        body = held[len(self.start) :]
        stripped = body.lstrip()
        if not stripped:
            return None
        if not stripped.startswith("["):
            return len(self.start)  # no array: the marker alone, left in the content
        try:
            _, end = self._decoder.raw_decode(stripped)
        except ValueError:
            return None  # not complete yet (or never: `finish` releases it)
        return len(self.start) + len(body) - len(stripped) + end

    def _calls(self, raw: str) -> list[ToolCall] | None:
        try:
            array = json.loads(raw[len(self.start) :])
        except ValueError:
            return None
        if not isinstance(array, list) or not array:
            return None
        calls = [_named_json_call(obj) for obj in array]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "glm4": Glm4Parser,
    "deepseek_v3": DeepSeekV3Parser,
    "mistral": MistralParser,
}


def new_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolCallParser:
    """A fresh parser of format `name` for one answer."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tools)


def parse_tool_calls(
    text: str, parser: str = "hermes", tools: list[dict[str, Any]] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """A whole answer → (content, tool calls). With calls, the content is what is left around
    them, stripped (None when nothing is); without, it is `text` unchanged."""
    p = new_parser(parser, tools)
    first, last = p.feed(text), p.finish()
    calls = first.calls + last.calls
    if not calls:
        return text, []
    return (first.content + last.content).strip() or None, calls


def parser_text(tokenizer: Any, text: str, output_ids: list[int], parser: str) -> str:
    """The answer's text as the parser must see it. Decoding skips special tokens; where a
    format's markers are special tokens of this tokenizer, they are decoded back in (and every
    other special token still left out)."""
    markers = set(TOOL_PARSERS[parser].markers)
    special = {str(t) for t in tokenizer.all_special_tokens} | {
        tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special
    }
    if not markers & special:
        return text
    keep = [
        i
        for i in output_ids
        if (tok := tokenizer.convert_ids_to_tokens(i)) not in special or tok in markers
    ]
    return tokenizer.decode(keep, skip_special_tokens=False)
