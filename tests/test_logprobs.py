"""Top-k and chosen-id log-probs, the server's limits and its info routes, through a real engine
server on loopback and the real `openai` client; every log-prob is checked against a full fp32
forward of the tiny model (top-k entries against `torch.topk` of `log_softmax(logits / T)`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from tests.servers import (  # noqa: E402
    STEP_TIMEOUT_S,
    Engine,
    LoopThread,
    call,
    new_serving,
    serve_engine,
    tiny_model,
)
from verst.engine import GenerateRequest, SamplingParams  # noqa: E402
from verst.fleet.bodies import output_from_body, request_body  # noqa: E402

PROMPT = [40, 41, 42, 43, 44, 45]
CONTEXT = 128  # the tiny model's max_position_embeddings


@dataclass
class Server:
    loop: LoopThread
    engine: Engine
    reference: transformers.PreTrainedModel  # the same weights, loaded apart, in float32

    @property
    def url(self) -> str:
        return self.engine.url

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        return self.loop.run(call(self.url, path, body))

    def get(self, path: str) -> tuple[int, Any]:
        return self.loop.run(call(self.url, path, method="GET"))

    def forward_logprobs(self, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
        """log_softmax(logits / T) of a full forward: row t predicts token t + 1."""
        with torch.no_grad():
            logits = self.reference(torch.tensor([tokens])).logits[0].float()
        return torch.log_softmax(logits / temperature, dim=-1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, loop: LoopThread) -> Iterator[Server]:
    model_dir = tiny_model(tmp_path_factory.mktemp("models"))
    engine = loop.run(serve_engine(new_serving(model_dir)))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32
    ).eval()
    yield Server(loop, engine, reference)
    loop.run(engine.runner.cleanup())


def text_of(server: Server, token_id: int) -> str:
    return server.engine.serving.tokenizer.decode([token_id])


def assert_top(
    entries: list[list[Any]], expected_V: torch.Tensor, k: int, server: Server | None = None
) -> None:
    """One position's top-k triples equal torch.topk of the reference row (texts, if given)."""
    values, ids = expected_V.topk(k)
    assert [e[1] for e in entries] == ids.tolist()
    assert [e[0] for e in entries] == pytest.approx(values.tolist(), abs=1e-5)
    if server is not None:
        assert [e[2] for e in entries] == [text_of(server, i) for i in ids.tolist()]


# ---- /generate -------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generate_top_k_and_chosen_ids_equal_a_full_forward(
    server: Server, temperature: float
) -> None:
    asked = [3, 57, 3, 99]  # order and repeats are kept, as SGLang keeps them
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 6,
            "temperature": temperature,
            "ignore_eos": True,
            "sampling_seed": 5,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 4,
        "token_ids_logprob": asked,
        "return_text_in_logprobs": True,
    }
    status, out = server.post("/generate", body)
    assert status == 200, out
    meta, ids = out["meta_info"], out["output_ids"]
    expected = server.forward_logprobs(PROMPT + ids, temperature or 1.0)
    # Input: positions 0..5, the first predicted by nothing (null), as SGLang.
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    assert len(meta["input_top_logprobs"]) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        assert_top(meta["input_top_logprobs"][pos], expected[pos - 1], 4, server)
        chosen = meta["input_token_ids_logprobs"][pos]
        assert [c[1] for c in chosen] == asked
        assert [c[0] for c in chosen] == pytest.approx(expected[pos - 1, asked].tolist(), abs=1e-5)
    triples = meta["input_token_logprobs"]
    assert [t[1] for t in triples] == PROMPT and triples[0][0] is None
    assert [t[2] for t in triples] == [text_of(server, t) for t in PROMPT]  # text filled
    # Output: position j is predicted by row len(PROMPT) - 1 + j.
    assert len(meta["output_top_logprobs"]) == len(ids) == 6
    for j, token in enumerate(ids):
        row = expected[len(PROMPT) - 1 + j]
        assert_top(meta["output_top_logprobs"][j], row, 4, server)
        lp, tid, text = meta["output_token_logprobs"][j]
        assert (tid, text) == (token, text_of(server, token))
        assert lp == pytest.approx(row[token].item(), abs=1e-5)
        chosen = meta["output_token_ids_logprobs"][j]
        assert [c[0] for c in chosen] == pytest.approx(row[asked].tolist(), abs=1e-5)
        assert [c[2] for c in chosen] == [text_of(server, t) for t in asked]
    if temperature == 0:
        assert [entries[0][1] for entries in meta["output_top_logprobs"]] == ids


def test_generate_extras_per_prompt_and_only_with_return_logprob(server: Server) -> None:
    prompts = [PROMPT, [50, 51, 52]]
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    body = {
        "input_ids": prompts,
        "sampling_params": greedy,
        "return_logprob": True,
        "top_logprobs_num": [2, 0],
        "token_ids_logprob": [None, [7]],
    }
    status, batch = server.post("/generate", body)
    assert status == 200, batch
    first, second = (r["meta_info"] for r in batch)
    assert [len(e) for e in first["output_top_logprobs"]] == [2, 2, 2]
    assert "output_token_ids_logprobs" not in first
    assert "output_top_logprobs" not in second
    expected = server.forward_logprobs(prompts[1] + batch[1]["output_ids"])
    assert [e[0][0] for e in second["output_token_ids_logprobs"]] == pytest.approx(
        expected[2:5, 7].tolist(), abs=1e-5
    )
    # Without logprob_start_len the input entries cover the last prompt token only (SGLang).
    assert first["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    assert first["input_top_logprobs"] == [None]
    # SGLang reads them only with return_logprob.
    status, plain = server.post("/generate", {**body, "return_logprob": False})
    assert status == 200
    assert not any("logprobs" in key for key in plain[0]["meta_info"])


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"top_logprobs_num": -1}, "top_logprobs_num"),
        ({"top_logprobs_num": "3"}, "top_logprobs_num"),
        ({"top_logprobs_num": 101}, "vocabulary"),
        ({"token_ids_logprob": [1, 100]}, "out-of-vocabulary token id 100"),
        ({"token_ids_logprob": [1, True]}, "token_ids_logprob"),
        ({"token_ids_logprob": "1"}, "token_ids_logprob"),
    ],
    ids=repr,
)
def test_bad_logprob_options_are_400(server: Server, extra: dict, needle: str) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True, **extra}
    status, answer = server.post("/generate", body)
    assert status == 400 and needle in str(answer)


def test_scheduler_extras_span_prefill_chunks_and_mixed_batches(server: Server) -> None:
    """In-process, with prompts scored across several chunks and rows that ask for nothing
    batched with rows that do: the extras are those of the full forward, row by row."""
    scheduler = server.engine.serving.scheduler
    chunk = scheduler.chunk_tokens
    scheduler.chunk_tokens = 4  # the 9-token prompt is scored in three chunks
    try:
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        long_prompt = [30 + i for i in range(9)]
        asking = GenerateRequest(
            long_prompt, params, rid="ask", logprob_start_len=2, top_logprobs_num=3
        )
        silent = GenerateRequest(PROMPT, params, rid="plain")
        outs = scheduler.generate([silent, asking])
    finally:
        scheduler.chunk_tokens = chunk
    plain, asked = outs
    assert plain.output_top_logprobs == [] and plain.input_top_logprobs == []
    expected = server.forward_logprobs(long_prompt + asked.output_ids)
    assert asked.input_top_logprobs[0] is None and len(asked.input_top_logprobs) == 7
    for pos, entries in enumerate(asked.input_top_logprobs[1:], start=3):
        assert_top([[lp, tid] for lp, tid in entries], expected[pos - 1], 3)
    for j, entries in enumerate(asked.output_top_logprobs):
        assert_top([[lp, tid] for lp, tid in entries], expected[len(long_prompt) - 1 + j], 3)


# ---- OpenAI ----------------------------------------------------------------------------------


def openai_call(server: Server, fn: Any) -> Any:
    async def run() -> Any:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0
        ) as client:
            return await fn(client)

    return server.loop.run(run())


def test_openai_chat_top_logprobs(server: Server) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    response = openai_call(
        server,
        lambda c: c.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        ),
    )
    content = response.choices[0].logprobs.content
    tokenizer = server.engine.serving.tokenizer
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    native = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    status, out = server.post("/generate", native)
    assert status == 200
    meta = out["meta_info"]
    assert len(content) == len(out["output_ids"]) == response.usage.completion_tokens
    expected = server.forward_logprobs(ids + out["output_ids"])
    for j, (entry, token) in enumerate(zip(content, out["output_ids"], strict=True)):
        row = expected[len(ids) - 1 + j]
        assert entry.token == text_of(server, token)
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-5)
        values, top_ids = row.topk(3)
        assert [t.token for t in entry.top_logprobs] == [text_of(server, i) for i in top_ids]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the top
    # (not bit-equal: this prompt's KV now comes from the prefix cache)
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        [e.logprob for e in content], abs=1e-5
    )
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        openai_call(
            server,
            lambda c: c.chat.completions.create(
                model="tiny", messages=messages, max_tokens=2, top_logprobs=2
            ),
        )


def test_openai_completions_logprobs_and_echo(server: Server) -> None:
    tokenizer = server.engine.serving.tokenizer
    prompt = "abc de"
    ids = tokenizer.encode(prompt)

    def complete(**kw: Any) -> Any:
        return openai_call(
            server,
            lambda c: c.completions.create(
                model="tiny", prompt=prompt, max_tokens=4, temperature=0, **kw
            ),
        )

    plain = complete()
    echoed = complete(echo=True, logprobs=2)
    choice = echoed.choices[0]
    assert plain.choices[0].logprobs is None
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    n_out = echoed.usage.completion_tokens
    assert len(lp.tokens) == len(ids) + n_out == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.tokens[: len(ids)] == [text_of(server, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    status, native = server.post(
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True,
        },
    )
    full = ids + native["output_ids"]
    expected = server.forward_logprobs(full)
    assert lp.token_logprobs[1:] == pytest.approx(
        [expected[t - 1, full[t]].item() for t in range(1, len(full))], abs=1e-5
    )
    for t in range(1, len(full)):
        values, top_ids = expected[t - 1].topk(2)
        assert lp.top_logprobs[t] == pytest.approx(
            {text_of(server, i): v for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)},
            abs=1e-5,
        )
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]
    no_top = complete(logprobs=0).choices[0].logprobs
    assert no_top.top_logprobs == [] and len(no_top.tokens) == n_out
    echo_only = complete(echo=True).choices[0]
    assert echo_only.text == choice.text and echo_only.logprobs is None


# ---- limits and info -------------------------------------------------------------------------


def test_max_new_tokens_past_the_context_is_400(server: Server) -> None:
    fits = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": CONTEXT - len(PROMPT)}}
    assert server.post("/generate", fits)[0] == 200
    over = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": CONTEXT - len(PROMPT) + 1}}
    status, body = server.post("/generate", over)
    assert status == 400
    assert body["error"]["message"] == (
        f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens. "
        f"You requested a total of {CONTEXT + 1} tokens: {len(PROMPT)} tokens from the input "
        f"messages and {CONTEXT - len(PROMPT) + 1} tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit."
    )
    # Without max_new_tokens the default (128) is capped at the context, as SGLang caps it.
    status, out = server.post("/generate", {"input_ids": PROMPT, "sampling_params": {}})
    assert status == 200 and out["meta_info"]["completion_tokens"] <= CONTEXT - len(PROMPT)
    for create in (
        lambda c: c.completions.create(model="tiny", prompt="hi", max_tokens=CONTEXT),
        lambda c: c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=CONTEXT
        ),
    ):
        with pytest.raises(openai.BadRequestError, match="maximum context length of 128"):
            openai_call(server, create)
    chat = openai_call(  # no max_tokens: the rest of the context
        server,
        lambda c: c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        ),
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_server_info_models_and_tokenize(server: Server) -> None:
    pool = server.engine.serving.scheduler.pool
    for path in ("/server_info", "/get_server_info"):
        status, info = server.get(path)
        assert status == 200
        assert info["max_total_num_tokens"] == pool.num_pages * pool.page_size
        assert info["max_req_input_len"] == min(CONTEXT - 1, info["max_total_num_tokens"] - 1)
    card = openai_call(server, lambda c: c.models.retrieve("tiny"))
    assert (card.id, card.object) == ("tiny", "model")
    with pytest.raises(openai.NotFoundError):
        openai_call(server, lambda c: c.models.retrieve("other/model"))

    tokenizer = server.engine.serving.tokenizer
    for prefix in ("", "/v1"):
        status, body = server.post(f"{prefix}/tokenize", {"prompt": "hello"})
        assert status == 200
        assert body == {
            "tokens": tokenizer.encode("hello"),
            "count": len(tokenizer.encode("hello")),
            "max_model_len": CONTEXT,
        }
        status, text = server.post(f"{prefix}/detokenize", {"tokens": body["tokens"]})
        assert (status, text) == (200, {"text": "hello"})
    status, many = server.post("/v1/tokenize", {"prompt": ["a", "bc"], "add_special_tokens": False})
    assert many["count"] == [1, 2]
    status, texts = server.post("/v1/detokenize", {"tokens": many["tokens"]})
    assert texts == {"text": ["a", "bc"]}
    for path, bad in (
        ("/v1/tokenize", {"prompt": 5}),
        ("/v1/detokenize", {"tokens": [1, "x"]}),
        ("/v1/detokenize", {"tokens": [100]}),
    ):
        status, answer = server.post(path, bad)
        assert status == 400 and answer["object"] == "error", answer


class Throttle:
    """Lets the scheduler run `steps` steps, then holds the next one until released, so a
    test can act while a step is in flight."""

    def __init__(self, scheduler: Any, steps: int) -> None:
        self.scheduler, self.release = scheduler, threading.Event()
        self.held = threading.Event()
        real, left = scheduler.step, [steps]

        def step() -> Any:
            if left[0] == 0:
                self.held.set()
                self.release.wait(STEP_TIMEOUT_S)
            left[0] -= 1
            return real()

        scheduler.step = step

    def close(self) -> None:
        self.release.set()
        del self.scheduler.step


def test_an_aborted_request_returns_its_tokens_and_log_probs(server: Server) -> None:
    serving = server.engine.serving
    greedy = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    body = {
        "input_ids": PROMPT,
        "sampling_params": greedy,
        "rid": "to-abort",
        "return_logprob": True,
        "top_logprobs_num": 2,
    }

    async def scenario() -> Any:
        throttle = Throttle(serving.scheduler, steps=6)  # a prefill and five decode steps
        try:
            task = asyncio.ensure_future(call(server.url, "/generate", body))
            while not throttle.held.is_set():
                await asyncio.sleep(0.005)
            await call(server.url, "/abort_request", {"rid": "to-abort"})
            return await task
        finally:
            throttle.close()

    status, aborted = server.loop.run(scenario())
    assert status == 200
    meta, ids = aborted["meta_info"], aborted["output_ids"]
    assert meta["finish_reason"]["type"] == "abort"
    assert len(ids) == 6 == meta["completion_tokens"]
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 6
    status, whole = server.post("/generate", {**body, "rid": "whole"})
    assert ids == whole["output_ids"][:6]
    assert meta["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"][:6]
    assert meta["output_top_logprobs"] == whole["meta_info"]["output_top_logprobs"][:6]


def test_fleet_bodies_carry_the_extras_both_ways(server: Server) -> None:
    """A `GenerateRequest` asking for extras, sent as the fleet sends it to an HTTP engine, comes
    back as the same `GenerateOutput` the scheduler gives in-process."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)

    def request(rid: str) -> GenerateRequest:
        return GenerateRequest(
            PROMPT, params, rid=rid, logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=[9]
        )

    status, answer = server.post("/generate", request_body(request("over-http")))
    assert status == 200, answer
    remote = output_from_body(request("over-http"), answer)
    local = server.engine.serving.scheduler.generate([request("local")])[0]
    assert remote.output_ids == local.output_ids
    for field in ("output_top_logprobs", "input_top_logprobs"):
        for got, want in zip(getattr(remote, field), getattr(local, field), strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert [t for _, t in got] == [t for _, t in want]
                assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-5)
    assert remote.input_token_ids_logprobs[0] is None is local.input_token_ids_logprobs[0]
    for field in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
        got = [row[0] for row in getattr(remote, field) if row is not None]
        want = [row[0] for row in getattr(local, field) if row is not None]
        assert len(got) == len(want) > 0 and got == pytest.approx(want, abs=1e-5)
