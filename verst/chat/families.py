"""The chat-template families verst knows, keyed by name, and how a template is matched to one.

A family says what a token-in-token-out tokeniser cannot always read off a dummy render: the
text its template writes after an assistant turn's content (`close`), the strings after which
the assistant's own text starts (`openers`: a header, or the end of a tool-output block that
the model continues after) and those that start another message (`turn_starts`), the tokens a
model of the family stops on besides the close (`stops`), and the format
of its tool calls (`tool_parser`, a key of `verst.chat.tool_parsers.TOOL_PARSERS`). Families
whose template verst ships (`template`) are rendered from `verst/chat/templates/`, verst's own
rendition of each published format, token for token; see docs/chat_templates.md.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class ChatFamily:
    """One chat-template family (see the module docstring)."""

    name: str
    markers: tuple[str, ...]  # all of these in a template's source → this family
    close: str | None  # after an assistant turn's content; None: read it off the template
    tool_parser: str
    openers: tuple[str, ...] = ()
    stops: tuple[str, ...] = ()
    turn_starts: tuple[str, ...] = ()  # strings that open a message that is not the assistant's
    template: str | None = None  # file name under verst/chat/templates/


# Detection order matters: the first family whose markers are all in the template wins.
FAMILIES: dict[str, ChatFamily] = {
    f.name: f
    for f in (
        ChatFamily(
            "qwen3", ("<|im_start|>", "</think>"), "<|im_end|>\n", "hermes", template="qwen3.jinja"
        ),
        ChatFamily("chatml", ("<|im_start|>",), "<|im_end|>\n", "hermes"),
        ChatFamily("llama3", ("<|start_header_id|>",), "<|eot_id|>", "hermes"),
        ChatFamily(
            "glm4",
            ("<|assistant|>", "<|observation|>"),
            "",
            "glm4",
            openers=("<|assistant|>",),
            # GLM-4.x ends a turn on the token that opens the next one.
            stops=("<|user|>", "<|observation|>", "<|system|>", "<|endoftext|>"),
            turn_starts=("<|user|>", "<|observation|>", "<|system|>"),
            template="glm4.jinja",
        ),
        ChatFamily(
            "deepseek_v3",
            ("<｜Assistant｜>",),
            "<｜end▁of▁sentence｜>",
            "deepseek_v3",
            # After tool outputs the model continues without a new assistant header.
            openers=("<｜Assistant｜>", "<｜tool▁outputs▁end｜>"),
            turn_starts=("<｜User｜>", "<｜tool▁outputs▁begin｜>"),
            template="deepseek_v3.jinja",
        ),
        ChatFamily(
            "mistral",
            ("[INST]",),
            "</s>",
            "mistral",
            openers=("[/INST]", "[/TOOL_RESULTS]"),
            turn_starts=("[INST]", "[TOOL_RESULTS]", "[SYSTEM_PROMPT]"),
            template="mistral.jinja",
        ),
        ChatFamily("default", (), None, "hermes"),
    )
}


def get_family(name: str) -> ChatFamily:
    """The family called `name`; a ValueError naming the known ones otherwise."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown chat-template family {name!r}; known: {sorted(FAMILIES)}")
    return family


def detect_family(chat_template: str) -> str:
    """The name of the first family whose markers are all in the template ("default" if none)."""
    for family in FAMILIES.values():
        if family.markers and all(m in chat_template for m in family.markers):
            return family.name
    return "default"


@cache
def load_template(name: str) -> str:
    """The Jinja source of the template verst ships for family `name`."""
    family = get_family(name)
    if family.template is None:
        raise ValueError(f"verst ships no template for family {name!r} (it uses the model's own)")
    return (importlib.resources.files("verst.chat") / "templates" / family.template).read_text()


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them: an assistant tool call's `arguments` as an object
    (OpenAI sends a JSON string; templates iterate or `tojson` it), as SGLang does. Arguments
    that are not a JSON object are left as they are."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            out.append(message)
            continue
        message = {**message, "tool_calls": copy.deepcopy(calls)}
        for call in message["tool_calls"]:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    parsed = json.loads(fn["arguments"])
                except ValueError:
                    continue
                if isinstance(parsed, dict):
                    fn["arguments"] = parsed
        out.append(message)
    return out
