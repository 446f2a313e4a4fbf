"""Tool-call parsers of every family's format: a whole answer and the same answer fed one
character at a time give the same content and calls; malformed or unfinished calls stay in the
content; GLM-4 values follow the tool's schema; special-token markers are decoded back in."""

from __future__ import annotations

import json

import pytest

from tests.chat_tokenizers import char_tokenizer
from verst.chat.tool_parsers import new_parser, parse_tool_calls, parser_text

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "note",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
            },
        },
    }
]
DS_CALL = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
)

# Per format: an answer with text before, two calls (add(a=2), note(text="5", n=1)), text after.
ANSWERS = {
    "hermes": 'Let me see. <tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "note", "arguments": {"text": "5", "n": 1}}\n</tool_call> Done.',
    "glm4": "Let me see. <tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n"
    "</tool_call><tool_call>note\n<arg_key>text</arg_key>\n<arg_value>5</arg_value>\n"
    "<arg_key>n</arg_key>\n<arg_value>1</arg_value>\n</tool_call> Done.",
    "deepseek_v3": "Let me see. <｜tool▁calls▁begin｜>"
    + DS_CALL.format(name="add", args='{"a": 2}')
    + "\n"
    + DS_CALL.format(name="note", args='{"text": "5", "n": 1}')
    + "<｜tool▁calls▁end｜> Done.",
    "mistral": 'Let me see. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}}, '
    '{"name": "note", "arguments": {"text": "5", "n": 1}}] Done.',
}
EXPECTED = [("add", {"a": 2}), ("note", {"text": "5", "n": 1})]


def functions(calls: list[dict]) -> list[tuple[str, dict]]:
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        assert isinstance(c["function"]["arguments"], str)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt", list(ANSWERS))
def test_whole_and_incremental_parses_agree(fmt: str) -> None:
    text = ANSWERS[fmt]
    content, calls = parse_tool_calls(text, fmt, TOOLS)
    assert functions(calls) == EXPECTED
    assert " ".join(content.split()) == "Let me see. Done."
    parser = new_parser(fmt, TOOLS)
    streamed, streamed_calls, indices = "", [], []
    for ch in text:
        delta = parser.feed(ch)
        streamed += delta.content
        if delta.calls:
            indices.append(delta.first_index)
        streamed_calls += delta.calls
        # nothing of a call ever leaks into the content stream
        assert "tool" not in streamed.lower() and "[" not in streamed
    end = parser.finish()
    assert functions(streamed_calls + end.calls) == EXPECTED
    assert (streamed + end.content).strip() == content.strip()
    assert indices in ([0, 1], [0])  # DeepSeek-V3 releases its section of calls at once


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
        ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2}'),  # unfinished
        ("glm4", "<tool_call>\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"),
        ("glm4", "<tool_call>add\nstray text</tool_call>"),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜>" + DS_CALL.format(name="a", args="{x") + "<｜tool▁calls▁end｜>",
        ),
        ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": '),
        ("mistral", '[TOOL_CALLS][{"arguments": {}}]'),
        ("mistral", "[TOOL_CALLS] no array"),
    ],
)
def test_malformed_calls_stay_in_the_content(fmt: str, text: str) -> None:
    assert parse_tool_calls("Hi " + text, fmt, TOOLS) == ("Hi " + text, [])
    parser = new_parser(fmt, TOOLS)
    released = "".join(parser.feed(ch).content for ch in "Hi " + text) + parser.finish().content
    assert released == "Hi " + text


def test_a_partial_marker_is_held_back_until_it_is_not_one() -> None:
    parser = new_parser("hermes")
    assert parser.feed("a <tool").content == "a "
    assert parser.feed("s are fun").content == "<tools are fun"
    assert parser.finish().content == ""


def test_glm4_values_follow_the_schema() -> None:
    text = "<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>42</arg_value>\n"
    text += "<arg_key>n</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"
    _, calls = parse_tool_calls(text, "glm4", TOOLS)
    assert functions(calls) == [("note", {"text": "42", "n": 42})]
    _, calls = parse_tool_calls(text, "glm4", None)  # no schema: JSON where it parses
    assert functions(calls) == [("note", {"text": 42, "n": 42})]


def test_special_token_markers_are_decoded_back_in() -> None:
    specials = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"]
    tok = char_tokenizer(specials, "", "<s>", "</s>")
    ids = tok.encode('[TOOL_CALLS][{"name": "f", "arguments": {}}]</s>', add_special_tokens=False)
    text = tok.decode(ids, skip_special_tokens=True)
    assert "[TOOL_CALLS]" not in text
    visible = parser_text(tok, text, ids, "mistral")
    assert visible == '[TOOL_CALLS][{"name": "f", "arguments": {}}]'  # </s> still left out
    assert functions(parse_tool_calls(visible, "mistral")[1]) == [("f", {})]
    # markers that are ordinary tokens: the decoded text is used as it is
    assert parser_text(tok, "x<tool_call>", [], "hermes") == "x<tool_call>"


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="known"):
        new_parser("pythonic")
