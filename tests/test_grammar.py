"""Constrained decoding (`json_schema`, `regex`, `ebnf`) through xgrammar: the scheduler's
output matches the grammar under greedy and sampled decoding, the reported log-probs are the
constrained distribution's, and bad grammars are 400s naming the field; a real engine server
answers SGLang's `/generate` body and the official `openai` client's `response_format`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("xgrammar")
aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from tests.servers import LoopThread, call, new_serving, serve_engine, tiny_model  # noqa: E402
from verst.engine import GenerateRequest, SamplingParams  # noqa: E402
from verst.engine.grammar import Constraint  # noqa: E402

PROMPT = [40, 41, 42, 43]
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = tiny_model(tmp_path_factory.mktemp("models"))
    loop = LoopThread()
    serving = new_serving(model)
    engine = loop.run(serve_engine(serving))
    engine.loop = loop
    yield engine
    loop.run(engine.runner.cleanup())
    loop.close()


def _generate(server: Any, constraint: Constraint, **params: Any) -> Any:
    """The scheduler's own output (called while the server is idle)."""
    sampling = SamplingParams(max_new_tokens=120, constraint=constraint, **params)
    request = GenerateRequest(list(PROMPT), sampling, return_logprob=True)
    return server.serving.scheduler.generate([request])[0]


def _text(server: Any, ids: list[int]) -> str:
    return server.serving.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_the_regex_and_the_ebnf(server: Any, temperature: float) -> None:
    for seed in range(3):
        params = {"temperature": temperature, "sampling_seed": seed}
        out = _generate(server, Constraint("regex", r"(yes|no|maybe) [0-9]{2}"), **params)
        assert re.fullmatch(r"(yes|no|maybe) [0-9]{2}", _text(server, out.output_ids))
        assert out.finish_reason == "stop"  # a complete grammar allows only EOS
        out = _generate(server, Constraint("ebnf", 'root ::= ("ab" | "cd") "!" [xyz]?'), **params)
        assert re.fullmatch(r"(ab|cd)![xyz]?", _text(server, out.output_ids))


def test_json_schema_output_parses_and_validates(server: Any) -> None:
    for seed in range(3):
        out = _generate(
            server,
            Constraint("json_schema", json.dumps(SCHEMA)),
            temperature=1.0,
            sampling_seed=seed,
        )
        value = json.loads(_text(server, out.output_ids))
        assert set(value) == {"colour", "ok"} and value["colour"] in ("red", "green")
        assert isinstance(value["ok"], bool)


def test_log_probs_are_the_constrained_distributions(server: Any) -> None:
    """One digit, then the end: each reported log-prob is the model's log-softmax over the
    tokens the grammar allowed at that step (the ten digits, then the EOS tokens)."""
    out = _generate(server, Constraint("regex", "[0-9]"), temperature=1.0)
    scheduler, tokenizer = server.serving.scheduler, server.serving.tokenizer
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    allowed = [digits, scheduler.eos_token_ids]
    assert len(out.output_ids) == 2 and out.output_ids[0] in digits
    with torch.no_grad():
        ids = torch.tensor([PROMPT + out.output_ids[:1]])
        logits = scheduler.model(input_ids=ids).logits[0, -2:].float()
    for step, (token, tokens) in enumerate(zip(out.output_ids, allowed, strict=True)):
        expected = logits[step, token] - torch.logsumexp(logits[step, tokens], dim=0)
        assert out.output_token_logprobs[step] == pytest.approx(float(expected), abs=1e-4)


def test_generate_route_and_bad_grammars(server: Any) -> None:
    def post(params: dict[str, Any]) -> tuple[int, Any]:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, **params}}
        return server.loop.run(call(server.url, "/generate", body))

    status, body = post({"temperature": 0, "regex": "(left|right)"})
    assert status == 200 and body["text"] in ("left", "right"), body
    status, body = post({"regex": "(a", "temperature": 0})
    assert status == 400 and "regex does not compile" in body["error"]["message"], body
    status, body = post({"json_schema": "{not json"})
    assert status == 400 and "json_schema is not valid JSON" in body["error"]["message"], body
    status, body = post({"regex": "a", "ebnf": 'root ::= "a"'})
    assert status == 400 and "Only one of regex" in body["error"]["message"], body
    status, body = post({"regex": 3})
    assert status == 400 and "regex must be a string" in json.dumps(body), body


def test_openai_response_format_and_extra_regex(server: Any) -> None:
    async def ask() -> tuple[Any, Any, Any]:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0
        ) as client:
            messages = [{"role": "user", "content": "colour?"}]
            schema = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=80,
                temperature=0,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": SCHEMA},
                },
            )
            anything = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=80,
                temperature=0,
                response_format={"type": "json_object"},
            )
            regex = await client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=20,
                temperature=0,
                extra_body={"regex": "(up|down)"},
            )
            return schema, anything, regex

    schema, anything, regex = server.loop.run(ask())
    assert json.loads(schema.choices[0].message.content)["colour"] in ("red", "green")
    if anything.choices[0].finish_reason == "stop":  # a random model may still be inside it
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.lstrip().startswith("{")
    assert regex.choices[0].text in ("up", "down")
    status, body = server.loop.run(
        call(
            server.url,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "xml"},
            },
        )
    )
    assert status == 400 and "response_format.type" in json.dumps(body), body
