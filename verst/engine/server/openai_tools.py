"""`tools` and `tool_choice` on `/v1/chat/completions`, as SGLang has them: the tools are
rendered by the model's chat template (`tool_choice: "none"` leaves them out, as SGLang does),
and with `auto` the answer's tool calls are parsed in the format of the template's family
(`verst.chat`, shared with the session server) into `message.tool_calls` with
`finish_reason: "tool_calls"`.

`required` and a named function are enforced as SGLang enforces them: the answer is
constrained to a JSON array of `{"name": ..., "parameters": ...}` objects, one of the allowed
functions each with arguments that follow its `parameters` schema (`verst.engine.grammar`),
and that array is read back as the calls, whatever the template family's own format.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

from verst.chat.families import FAMILIES, detect_family
from verst.chat.tool_parsers import (
    ToolCall,
    make_call,
    new_parser,
    parse_tool_calls,
    parser_text,
)
from verst.engine.server.protocol_errors import openai_error
from verst.engine.streaming import REPLACEMENT

logger = logging.getLogger(__name__)

TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ChatTools:
    """A request's tools as the template renders them, and whether answers are parsed."""

    tools: list[dict[str, Any]]
    parse: bool  # tool_choice "auto": look for calls in the answer
    forced: tuple[str, ...] = ()  # "required" / a named function: the functions it must call
    parallel: bool = True  # OpenAI's parallel_tool_calls: a forced answer may make several

    def call_schema(self) -> str:
        """The JSON schema (as text) a forced answer is constrained to: a non-empty array of
        calls of the allowed functions."""
        by_name = {t["function"]["name"]: t["function"] for t in self.tools}
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": by_name[name].get("parameters") or {"type": "object"},
                },
                "required": ["name", "parameters"],
            }
            for name in self.forced
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return json.dumps(schema)


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise openai_error("tools must be a list of {type: 'function', function: {...}} objects")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise openai_error(f"tools[{i}] must be an object of type 'function'")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise openai_error(f"tools[{i}].function.name must be a non-empty string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise openai_error(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def _named(choice: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict):
        raise openai_error(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{type: 'function', function: {name: ...}}"
        )
    name = fn.get("name")
    if name not in {t["function"]["name"] for t in tools}:
        raise openai_error(f"tool_choice names function {name!r}, which is not in tools")
    return str(name)


def chat_tools(payload: dict[str, Any]) -> ChatTools | None:
    """The request's `tools` / `tool_choice` checked; None when no tools reach the template."""
    tools, choice = payload.get("tools"), payload.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise openai_error("tool_choice needs tools: a request without tools cannot call one")
        return None
    tools = _check_tools(tools)
    choice = "auto" if choice is None else choice
    parallel = payload.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise openai_error("parallel_tool_calls must be a boolean")
    if isinstance(choice, dict):
        return ChatTools(tools, parse=True, forced=(_named(choice, tools),), parallel=parallel)
    if choice not in TOOL_CHOICES:
        raise openai_error(f"tool_choice must be one of {list(TOOL_CHOICES)} or a named function")
    if choice == "required":
        names = tuple(t["function"]["name"] for t in tools)
        return ChatTools(tools, parse=True, forced=names, parallel=parallel)
    if choice == "none":
        return None
    return ChatTools(tools, parse=True)


@cache
def _tool_format(chat_template: str) -> str:
    return FAMILIES[detect_family(chat_template)].tool_parser


def template_format(tokenizer: Any) -> str:
    """The tool-call format of the tokenizer's chat-template family."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return _tool_format(template)


def tool_message(
    tokenizer: Any, result: dict[str, Any], tools: ChatTools, fmt: str | None = None
) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A `/generate` result's (content, tool_calls) in format `fmt` (None: the template
    family's); no calls leaves the text as the content and tool_calls None. A forced answer
    is the JSON array of calls its grammar allowed (cut short by max_tokens, it is content)."""
    if tools.forced:
        return _forced_calls(result["text"])
    fmt = fmt or template_format(tokenizer)
    text = parser_text(tokenizer, result["text"], result["output_ids"], fmt)
    content, calls = parse_tool_calls(text, fmt, tools.tools)
    if not calls:
        return result["text"], None
    return content, calls


def _forced_calls(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return text, None
    return None, [make_call(call["name"], call["parameters"]) for call in calls]


class ToolCallStream:
    """One streamed chat choice with tools: its cumulative results fed, as they decode, to the
    incremental parser of its format, and what that releases as OpenAI delta objects.

    Content streams as `{"content": ...}` (whitespace at its end is held back: the answer's
    content is stripped when it makes calls, as `tool_message` strips it); each call streams
    once the parser has its end (a call is held until then, so text that turns out not to be a
    well-formed call is released as content and no call is ever taken back), as OpenAI streams
    one: `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}`,
    then its `arguments`. A forced answer (`required`, a named function) is one JSON array its
    grammar keeps well-formed, read whole when it finishes. The streamed deltas reassemble to
    `tool_message`'s (content, calls)."""

    def __init__(self, tokenizer: Any, tools: ChatTools, fmt: str | None = None) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.fmt = fmt or template_format(tokenizer)
        self.parser = None if tools.forced else new_parser(self.fmt, tools.tools)
        self.fed = ""  # the parser text fed so far
        self.space = ""  # whitespace at the end of the content released so far, not yet sent
        self.calls = 0  # calls streamed so far

    def deltas(self, result: dict[str, Any], final: bool) -> list[dict[str, Any]]:
        """The delta objects one cumulative result (`finish_reason` set: `final`) adds."""
        if self.parser is None:
            if not final:
                return []
            content, calls = _forced_calls(result["text"])
            return self._calls(calls) if calls else self._content(content or "", True)
        text = parser_text(self.tokenizer, result["text"], result["output_ids"], self.fmt)
        parsed = self.parser.feed(self._new(text, final))
        out = self._content(parsed.content, False) + self._calls(parsed.calls)
        if final:
            last = self.parser.finish()
            out += self._content(last.content, True)
        return out

    def _new(self, text: str, final: bool) -> str:
        """`text` past what was fed; a character still being decoded waits for its last byte."""
        if not text.startswith(self.fed):  # a stop_regex match that began in text already fed
            logger.warning("a streamed tool-call answer's text does not extend the text fed")
            text = self.fed + text[len(os.path.commonprefix([self.fed, text])) :]
        if not final and text.endswith(REPLACEMENT):
            return ""
        new, self.fed = text[len(self.fed) :], text
        return new

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        if final and not self.calls:  # no call to strip the content around: it is all sent
            body, self.space = text, ""
        return [{"content": body}] if body else []

    def _calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            fn, index = call["function"], self.calls
            head = {"name": fn["name"], "arguments": ""}
            out.append(
                {
                    "tool_calls": [
                        {"index": index, "id": call["id"], "type": "function", "function": head}
                    ]
                }
            )
            out.append(
                {"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]}
            )
            self.calls += 1
        return out
