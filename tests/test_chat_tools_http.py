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


def test_a_streamed_answer_carries_its_tool_calls(server: Server) -> None:
    async def go() -> list[object]:
        async with server.client() as client:
            stream = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, stream=True, **server.forced()
            )
            return [chunk async for chunk in stream]

    chunks = server.loop.run(go())
    calls = [c for ch in chunks for choice in ch.choices for c in choice.delta.tool_calls or []]
    assert [(c.index, c.function.name) for c in calls] == [(0, "add")]
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


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
