"""Penalties, logit_bias, min_new_tokens, stop_regex and OpenAI `n` end to end: a real engine
server on 127.0.0.1, SGLang's `/generate` body and the official `openai` client, each result
checked against the in-process scheduler, and every bad value a 400 naming its field."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from tests.servers import LoopThread, call, new_serving, serve_engine, tiny_model  # noqa: E402
from verst.engine import GenerateRequest, SamplingParams  # noqa: E402
from verst.engine.serving import ServingEngine  # noqa: E402

PROMPT = [40, 41, 42, 43]
GREEDY = {"max_new_tokens": 30, "temperature": 0}
VARIED = {**GREEDY, "frequency_penalty": 1.0}  # the tiny model repeats one token without it


@dataclass
class Server:
    loop: LoopThread
    serving: ServingEngine
    url: str

    def generate(self, params: dict[str, Any], **body: Any) -> tuple[int, Any]:
        payload = {"input_ids": PROMPT, "sampling_params": params, **body}
        return self.loop.run(call(self.url, "/generate", payload))

    def reference(self, **params: Any) -> list[int]:
        """The scheduler's own output ids (called only while the server is idle)."""
        request = GenerateRequest(list(PROMPT), SamplingParams(**params))
        return self.serving.scheduler.generate([request])[0].output_ids

    def openai(self) -> Any:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_model(tmp_path_factory.mktemp("models"))
    loop = LoopThread()
    serving = new_serving(model)
    engine = loop.run(serve_engine(serving))
    yield Server(loop, serving, engine.url)
    loop.run(engine.runner.cleanup())
    loop.close()


def test_empty_lists_are_off_on_every_route(server: Server) -> None:
    """SGLang's frontend sends `stop: []`, `stop_regex: []` and friends on every call."""
    off = {
        **GREEDY,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "logit_bias": {},
        "min_new_tokens": 0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    status, body = server.generate(off)
    assert status == 200, body
    assert body["output_ids"] == server.reference(max_new_tokens=30, temperature=0)
    for path, extra in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        payload = {**extra, "max_tokens": 4, "stop": [], "stop_regex": [], "logit_bias": {}}
        status, body = server.loop.run(call(server.url, path, payload))
        assert status == 200, body


def test_repetition_penalty_changes_greedy_output_as_the_scheduler_does(server: Server) -> None:
    plain = server.reference(**GREEDY)
    status, body = server.generate({**GREEDY, "repetition_penalty": 1.5})
    assert status == 200, body
    assert body["output_ids"] == server.reference(**GREEDY, repetition_penalty=1.5)
    assert body["output_ids"] != plain and body["output_ids"][0] == plain[0]


def test_min_new_tokens_blocks_eos(server: Server) -> None:
    eos = set(server.serving.scheduler.eos_token_ids)
    status, body = server.generate(VARIED)
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "stop", body
    natural = body["meta_info"]["completion_tokens"]
    assert body["output_ids"][-1] in eos and natural < 25
    status, body = server.generate({**VARIED, "min_new_tokens": 25})
    assert status == 200, body
    assert body["meta_info"]["completion_tokens"] >= 25
    assert not eos & set(body["output_ids"][:25])
    assert (
        body["output_ids"]
        == server.reference(**VARIED, min_new_tokens=25)[: len(body["output_ids"])]
    )


def test_logit_bias_on_generate_and_openai(server: Server) -> None:
    status, body = server.generate({**GREEDY, "max_new_tokens": 6, "logit_bias": {"24": 100}})
    assert status == 200, body
    assert body["output_ids"] == [24] * 6

    async def chat() -> Any:
        async with server.openai() as client:
            return await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={"24": 100}
            )

    assert server.loop.run(chat()).choices[0].text == server.serving.tokenizer.decode([24] * 6)


def shortest_stop(server: Server, ids: list[int], pattern: str) -> tuple[int, int]:
    """(output tokens kept, characters of text kept): the first prefix whose text matches."""
    for k in range(1, len(ids) + 1):
        match = re.search(pattern, server.serving.tokenizer.decode(ids[:k]))
        if match:
            return k, match.start()
    raise AssertionError(f"{pattern!r} never matches")


def test_stop_regex_stops_generation_at_the_match(server: Server) -> None:
    full = server.reference(**VARIED)
    text = server.serving.tokenizer.decode(full)
    pattern = re.escape(text[4]) + "." + re.escape(text[6])  # a real regex: any middle char
    kept, chars = shortest_stop(server, full, pattern)
    steps = server.serving.num_batches
    status, body = server.generate({**VARIED, "max_new_tokens": 100, "stop_regex": [pattern]})
    assert status == 200, body
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert body["output_ids"] == full[:kept] and body["text"] == text[:chars]
    assert server.serving.num_batches - steps <= kept + 2  # it ended there, not at 100 tokens
    status, body = server.generate(
        {**VARIED, "stop_regex": pattern, "no_stop_trim": True}, return_logprob=True
    )
    assert body["text"] == text[: chars + 3]
    assert len(body["meta_info"]["output_token_logprobs"]) == kept

    async def completion() -> Any:
        async with server.openai() as client:
            return await client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=30,
                temperature=0,
                frequency_penalty=1.0,
                extra_body={"stop_regex": [pattern]},
            )

    choice = server.loop.run(completion()).choices[0]
    assert choice.text == text[:chars] and choice.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == pattern


def test_stop_strings_end_the_request_early(server: Server) -> None:
    full = server.reference(**VARIED)
    text = server.serving.tokenizer.decode(full)
    stop = text[5:7]
    steps = server.serving.num_batches
    status, body = server.generate({**VARIED, "max_new_tokens": 100, "stop": stop})
    assert status == 200, body
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert body["text"] == text[: text.find(stop)]
    assert server.serving.num_batches - steps <= len(body["output_ids"]) + 2


def test_openai_client_sends_penalties_min_tokens_and_n(server: Server) -> None:
    messages = [{"role": "user", "content": "hi there"}]

    async def chats() -> tuple[Any, Any, Any]:
        async with server.openai() as client:
            plain = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0
            )
            penalized = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=8,
                temperature=0,
                presence_penalty=1.5,
                extra_body={"repetition_penalty": 1.3, "min_tokens": 8},
            )
            three = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=5, n=3, seed=7, temperature=1.0
            )
            return plain, penalized, three

    plain, penalized, three = server.loop.run(chats())
    assert plain.choices[0].message.content != penalized.choices[0].message.content
    assert penalized.usage.completion_tokens == 8
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.message.content for c in three.choices}) > 1  # seed + j: three samples
    assert 3 <= three.usage.completion_tokens <= 15


BAD = [
    ("frequency_penalty", 2.5, "frequency_penalty"),
    ("presence_penalty", "high", "presence_penalty"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("repetition_penalty", 3.0, "repetition_penalty"),
    ("min_new_tokens", 40, "min_new_tokens"),
    ("min_new_tokens", -1, "min_new_tokens"),
    ("logit_bias", {"abc": 1.0}, "logit_bias"),
    ("logit_bias", {"3": "up"}, "logit_bias"),
    ("logit_bias", {"100000": 1.0}, "logit_bias"),
    ("logit_bias", [1, 2], "logit_bias"),
    ("stop_regex", "(unclosed", "stop_regex"),
    ("stop_regex", ["a"] * 33, "stop_regex"),
    ("stop_regex", "x" * 300, "stop_regex"),
    ("stop", "", "stop"),
]
OPENAI_NAMES = {"min_new_tokens": "min_tokens"}


@pytest.mark.parametrize("field,value,named", BAD, ids=lambda v: repr(v)[:30])
def test_bad_values_are_400_naming_the_field(
    server: Server, field: str, value: Any, named: str
) -> None:
    status, body = server.generate({**GREEDY, field: value})
    assert status == 400, body
    error = body["error"]
    assert named in (error if isinstance(error, str) else error["message"])
    name = OPENAI_NAMES.get(field, field)
    payload = {"prompt": PROMPT, "max_tokens": 30, name: value}
    status, body = server.loop.run(call(server.url, "/v1/completions", payload))
    assert status == 400 and body["object"] == "error", body
    assert name in body["message"], body
    status, body = server.generate(GREEDY)
    assert status == 200 and server.serving.load()["num_running_reqs"] == 0
