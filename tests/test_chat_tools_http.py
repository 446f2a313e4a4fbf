"""`tools` / `tool_choice` on the engine server's `/v1/chat/completions`, end to end with the
official `openai` client: the tools are rendered by the chat template (verst's Qwen3 rendition),
an answer's Hermes tool call comes back as `message.tool_calls` (OpenAI shape, id, arguments as
a JSON string) with `finish_reason: "tool_calls"`, `none` leaves the tools out of the prompt,
`required` and a named function constrain the answer to a JSON array of calls (through
xgrammar), and bad tools are 400s that say why.

The tiny model is random, so the tests make it call a tool: the tokenizer has the whole call
as one added token, and `logit_bias` with `stop_token_ids` makes it that answer's one token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from tests.chat_tokenizers import char_tokenizer  # noqa: E402
from tests.servers import LoopThread, new_serving, serve_engine, tiny_config  # noqa: E402
from verst.chat import load_template  # noqa: E402
from verst.models.tiny import build_tiny_model  # noqa: E402

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "blue"]}},
            "required": ["colour"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


@dataclass
class Server:
    loop: LoopThread
    url: str
    call_id: int

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def chat(self, **kwargs: object) -> object:
        async def go() -> object:
            async with self.client() as client:
                return await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, **kwargs
                )

        return self.loop.run(go())

    def forced(self, **kwargs: object) -> dict[str, object]:
        """Arguments that make the model answer with the whole tool call, then stop on it (and
        keep it in the text: `no_stop_trim`)."""
        extra = {"stop_token_ids": [self.call_id], "no_stop_trim": True}
        return {
            "temperature": 0,
            "max_tokens": 4,
            "logit_bias": {str(self.call_id): 100},
            "extra_body": extra,
            **kwargs,
        }


def write_model(root: Path) -> tuple[Path, int]:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = ["<tool_call>", "</tool_call>", "<think>", "</think>", CALL]
    tok = char_tokenizer(specials, load_template("qwen3"), None, "<|im_end|>", added)
    model = build_tiny_model(tiny_config(1024), vocab_size=len(tok), seed=0)  # tools take room
    model.save_pretrained(root, safe_serialization=True)
    tok.save_pretrained(root)
    return root, tok.convert_tokens_to_ids(CALL)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path, call_id = write_model(tmp_path_factory.mktemp("tools_model"))
    loop = LoopThread()
    engine = loop.run(serve_engine(new_serving(path)))
    yield Server(loop, engine.url, call_id)
    loop.run(engine.runner.cleanup())
    loop.close()


def test_a_tool_call_answer_comes_back_as_tool_calls(server: Server) -> None:
    reply = server.chat(tools=TOOLS, **server.forced())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert choice.message.content is None


def test_without_tools_the_same_answer_is_plain_content(server: Server) -> None:
    for kwargs in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        reply = server.chat(**server.forced(**kwargs))
        choice = reply.choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason == "stop"
        assert choice.message.content == CALL


def test_tools_are_rendered_by_the_template_and_none_leaves_them_out(server: Server) -> None:
    def prompt_tokens(**kwargs: object) -> int:
        return server.chat(max_tokens=1, temperature=0, **kwargs).usage.prompt_tokens

    plain = prompt_tokens()
    with_tools = prompt_tokens(tools=TOOLS)
    assert with_tools > plain + len(json.dumps(TOOLS[0]))  # the system prompt lists the tool
    assert prompt_tokens(tools=TOOLS, tool_choice="auto") == with_tools
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain


def _stream(server: Server, **kwargs: object) -> list[object]:
    async def go() -> list[object]:
        async with server.client() as client:
            stream = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, stream=True, **kwargs
            )
            return [chunk async for chunk in stream]

    return server.loop.run(go())


def _reassembled(chunks: list[object]) -> tuple[str, list[dict[str, str]], str | None]:
    """(content, calls, finish_reason) of one streamed choice, as a client puts them together:
    each call from the delta that opens it (index, id, name), its arguments appended."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.function.arguments == ""
                    calls[call.index] = {"id": call.id, "name": call.function.name, "args": ""}
                else:
                    assert call.function.name is None
                calls[call.index]["args"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _literal(text: str) -> str:
    """A regex (xgrammar's dialect) that matches `text` alone."""
    return re.sub(r"([.^$*+?{}\[\]|()\\])", r"\\\1", text)


def test_a_streamed_answer_carries_its_tool_calls(server: Server) -> None:
    chunks = _stream(server, tools=TOOLS, **server.forced())
    content, calls, finish = _reassembled(chunks)
    assert [(c["name"], json.loads(c["args"])) for c in calls] == [("add", {"a": 2, "b": 3})]
    assert finish == "tool_calls" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert content == ""


def test_streamed_tool_call_deltas_reassemble_to_the_answer(server: Server) -> None:
    """Text, then two calls over many tokens (a regex makes the random model write them): the
    text streams as content before the calls do, each call opens with its id and name, and the
    deltas reassemble to the non-streamed answer's content and calls."""
    pytest.importorskip("xgrammar")
    second = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 10}}\n</tool_call>'
    answer = "Adding now. " + CALL + "\n" + second
    kwargs = {
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 200,
        "logprobs": True,
        "extra_body": {"regex": _literal(answer)},
    }
    whole = server.chat(**kwargs).choices[0]
    chunks = _stream(server, **kwargs)
    streamed = [
        t.token for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.content
    ]
    assert streamed == [t.token for t in whole.logprobs.content]  # every token's, once
    content, calls, finish = _reassembled(chunks)
    assert whole.finish_reason == finish == "tool_calls"
    assert content == whole.message.content == "Adding now."
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c["name"], c["args"]) for c in calls] == expected
    assert json.loads(calls[1]["args"]) == {"a": 1, "b": 10}
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    # streamed as decoded: the content comes in chunks of its own before the first call
    kinds = [
        "content" if choice.delta.content else "call" if choice.delta.tool_calls else None
        for chunk in chunks
        for choice in chunk.choices
    ]
    kinds = [k for k in kinds if k]
    assert kinds.index("call") > 1 and "content" not in kinds[kinds.index("call") :]
    ends = [choice.finish_reason for chunk in chunks for choice in chunk.choices]
    assert ends[-1] == "tool_calls" and not any(ends[:-1])


def test_an_unfinished_call_streams_as_content(server: Server) -> None:
    """The answer ends inside a call: the text held back is content, as unstreamed."""
    pytest.importorskip("xgrammar")
    answer = "Hi " + CALL[:-4]
    kwargs = {
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 200,
        "extra_body": {"regex": _literal(answer)},
    }
    whole = server.chat(**kwargs).choices[0]
    content, calls, finish = _reassembled(_stream(server, **kwargs))
    assert whole.message.tool_calls is None and calls == []
    assert finish == whole.finish_reason == "stop"
    assert content == whole.message.content == answer


@pytest.mark.parametrize(
    ("tools", "choice"),
    [([PICK], "required"), (TOOLS + [PICK], {"type": "function", "function": {"name": "pick"}})],
)
def test_required_and_named_tool_choice_force_a_call(
    server: Server, tools: list, choice: object
) -> None:
    pytest.importorskip("xgrammar")
    for seed in range(2):
        answer = server.chat(
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=False,  # one call: a random model may never close the array
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )
        choice_0 = answer.choices[0]
        assert choice_0.finish_reason == "tool_calls" and choice_0.message.content is None
        assert choice_0.message.tool_calls, choice_0
        for call in choice_0.message.tool_calls:
            assert call.function.name == "pick" and call.id.startswith("call_")
            assert json.loads(call.function.arguments)["colour"] in ("red", "blue")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined with response_format",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "not in tools",
        ),
        ({"tool_choice": "auto"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0] must be"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    server: Server, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        server.chat(max_tokens=1, extra_body=kwargs)


def test_tool_call_parser_overrides_the_template_family(tmp_path: Path) -> None:
    """`verst serve --tool-call-parser NAME` (make_app's `tool_call_parser`) picks the format."""
    from transformers import AutoTokenizer

    from verst.engine.server.openai_tools import ChatTools, tool_message

    path, call_id = write_model(tmp_path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    result = {"text": CALL, "output_ids": [call_id]}
    tools = ChatTools(TOOLS, parse=True)
    content, calls = tool_message(tok, result, tools)  # qwen3 template: Hermes
    assert content is None and calls[0]["function"]["name"] == "add"
    assert tool_message(tok, result, tools, "mistral") == (CALL, None)
