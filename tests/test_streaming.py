"""Streaming by token: `stream: true` on `/generate` (SGLang's cumulative SSE chunks) and on the
OpenAI routes (the real `openai` client), against a tiny `verst serve` app on loopback; and the
incremental detokenizer on a byte-level BPE tokenizer trained in-process, where one character
spans several tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from tests.servers import LoopThread, call, new_serving, serve_engine, tiny_model  # noqa: E402
from verst.engine import GenerateRequest, SamplingParams  # noqa: E402
from verst.engine.results import DetokenizeParams, ResultShaper  # noqa: E402
from verst.engine.serving import ServingEngine  # noqa: E402
from verst.engine.streaming import IncrementalText, StreamState  # noqa: E402

PROMPT = [40, 41, 42, 43]
GREEDY_20 = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "hello"}]


@dataclass
class Server:
    loop: LoopThread
    serving: ServingEngine
    url: str

    def run(self, coro: Any) -> Any:
        return self.loop.run(coro)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    loop = LoopThread()
    serving = new_serving(tiny_model(tmp_path_factory.mktemp("models")))
    engine = loop.run(serve_engine(serving))
    yield Server(loop, serving, engine.url)
    loop.run(engine.runner.cleanup())
    loop.close()


async def sse(url: str, path: str, body: Any) -> list[tuple[float, Any]]:
    """A streamed response's events as (arrival time, parsed JSON or "[DONE]")."""
    events: list[tuple[float, Any]] = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            async for line in response.content:
                text = line.decode().strip()
                if text.startswith("data: "):
                    data = text.removeprefix("data: ")
                    events.append(
                        (time.perf_counter(), data if data == "[DONE]" else json.loads(data))
                    )
    return events


def test_generate_streams_cumulative_chunks_as_tokens_decode(server: Server) -> None:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY_20, "return_logprob": True}
    status, whole = server.run(call(server.url, "/generate", body))
    assert status == 200
    events = server.run(sse(server.url, "/generate", {**body, "stream": True}))
    assert events[-1][1] == "[DONE]"
    chunks = [chunk for _, chunk in events[:-1]]
    partial = [c for c in chunks if c["meta_info"]["finish_reason"] is None]
    assert len(partial) > 1 and chunks[-1]["meta_info"]["finish_reason"] is not None
    assert events[0][0] < events[-2][0]  # the first chunk came before the finish
    for before, after in zip(chunks, chunks[1:], strict=False):  # cumulative, as SGLang's default
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    for chunk in partial:
        meta = chunk["meta_info"]
        assert meta["completion_tokens"] == len(chunk["output_ids"])
        assert len(meta["output_token_logprobs"]) == len(chunk["output_ids"])
        assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    streamed = last["meta_info"]["output_token_logprobs"]
    assert [token for _, token, _ in streamed] == [
        token for _, token, _ in whole["meta_info"]["output_token_logprobs"]
    ]
    assert [lp for lp, _, _ in streamed] == same_logprobs(
        [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"]]
    )


def test_streamed_text_never_runs_past_a_stop_string(server: Server) -> None:
    status, free = server.run(
        call(server.url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY_20})
    )
    text = free["text"]
    assert status == 200 and len(text) >= 10
    stop = text[6:9]
    params = {**GREEDY_20, "stop": [stop]}
    body = {"input_ids": PROMPT, "sampling_params": params}
    whole = server.run(call(server.url, "/generate", body))[1]
    events = server.run(sse(server.url, "/generate", {**body, "stream": True}))
    chunks = [chunk for _, chunk in events[:-1]]
    assert chunks[-1]["text"] == whole["text"] == text[: text.index(stop)]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert all(whole["text"].startswith(c["text"]) for c in chunks)


def test_stream_interval_and_n_with_index(server: Server) -> None:
    params = {**GREEDY_20, "stream_interval": 5, "n": 2}
    events = server.run(
        sse(
            server.url,
            "/generate",
            {"input_ids": PROMPT, "sampling_params": params, "stream": True},
        )
    )
    chunks = [chunk for _, chunk in events[:-1]]
    assert {c["index"] for c in chunks} == {0, 1}
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        assert len(mine) <= 6  # the first token, then every 5, then the finish
        lengths = [len(c["output_ids"]) for c in mine if c["meta_info"]["finish_reason"] is None]
        # a chunk goes out at the first token, then once 5 more have come (more when the
        # steps outran the sender, as on a loaded machine)
        assert lengths and all(b - a >= 5 for a, b in zip(lengths, lengths[1:], strict=False))
        assert len(mine[-1]["output_ids"]) == 20


def test_openai_chat_stream_with_the_real_client(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    args = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0] is [c for c in chunks if c.choices][-1]
    assert finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.logprob for t in tokens] == same_logprobs(
        [t.logprob for t in whole.choices[0].logprobs.content]
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert len({c.id for c in chunks}) == 1


def test_openai_completions_stream_n_and_logprobs(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    args = dict(model="tiny", prompt="abc", max_tokens=12, temperature=0, n=2, logprobs=2)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine) == whole.choices[index].text
        assert mine[-1].finish_reason == whole.choices[index].finish_reason
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.token_logprobs]
        assert tokens == same_logprobs(whole.choices[index].logprobs.token_logprobs)
        offsets = [o for c in mine if c.logprobs for o in c.logprobs.text_offset]
        assert offsets == whole.choices[index].logprobs.text_offset


def same_logprobs(expected: list[float]) -> Any:
    """The streamed request reuses the first one's cached prefix, so its prefill runs on other
    matrix shapes: the log-probabilities agree to rounding, not bit for bit."""
    return pytest.approx(expected, rel=1e-5, abs=1e-6)


@contextlib.contextmanager
def slow_steps(serving: ServingEngine, delay_s: float = 0.02) -> Iterator[None]:
    """Every scheduler step takes at least `delay_s`: 100 tokens take 2 s or more."""
    real = serving.scheduler.step

    def slow() -> Any:
        time.sleep(delay_s)
        return real()

    serving.scheduler.step = slow  # type: ignore[method-assign]
    try:
        yield
    finally:
        del serving.scheduler.step


def test_a_client_that_leaves_a_stream_frees_its_request(server: Server) -> None:
    serving = server.serving

    async def leave_after_two_chunks() -> None:
        body = {
            "input_ids": PROMPT,
            "rid": "leaver",
            "stream": True,
            "sampling_params": {"max_new_tokens": 100, "ignore_eos": True},
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/generate", json=body) as response:
                seen = 0
                async for line in response.content:
                    seen += line.startswith(b"data: ")
                    if seen == 2:
                        break
        left_s = time.perf_counter()
        for _ in range(200):  # the engine drops it and its KV before its next step
            if serving.rid_is_free("leaver") and not serving.scheduler.running:
                break
            await asyncio.sleep(0.005)
        assert serving.rid_is_free("leaver") and not serving.scheduler.running
        assert time.perf_counter() - left_s < 1.0  # long before its 100 tokens were done
        assert serving.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}
        assert not serving._streams

    with slow_steps(serving):
        server.run(leave_after_two_chunks())


def test_abort_request_ends_a_stream_cleanly(server: Server) -> None:
    async def abort_mid_stream() -> list[Any]:
        body = {
            "input_ids": PROMPT,
            "rid": "to-abort",
            "stream": True,
            "sampling_params": {"max_new_tokens": 100, "ignore_eos": True},
        }
        events = []
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/generate", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: "):
                        data = line.decode().strip().removeprefix("data: ")
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if len(events) == 2:
                            await call(server.url, "/abort_request", {"rid": "to-abort"})
        return events

    with slow_steps(server.serving):
        events = server.run(abort_mid_stream())
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < 100
    assert server.serving.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}


def test_a_bad_streamed_request_is_a_400_before_the_stream(server: Server) -> None:
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"stream_interval": 0}}
    status, answer = server.run(call(server.url, "/generate", body))
    assert status == 400 and "stream_interval" in answer["error"]["message"]
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": "yes"}}
    status, answer = server.run(call(server.url, "/v1/chat/completions", body))
    assert status == 400 and "include_usage" in answer["message"]


@pytest.mark.parametrize(
    "field",
    [{"cache_salt": "tenant-a"}, {"return_entropy": True}, {"sampling_params": {"watermark": {}}}],
)
def test_fields_not_implemented_are_a_400_unless_off(server: Server, field: Any) -> None:
    """Every S23 field of the protocol table marked "not yet": its off value is accepted (SGLang's
    frontends send some on every call), any other is a 400 naming it, never ignored."""
    off = {"cache_salt": None, "return_entropy": False, "sampling_params": {"choice": []}}
    body = {"input_ids": PROMPT, **off}
    assert server.run(call(server.url, "/generate", body))[0] == 200
    status, answer = server.run(call(server.url, "/generate", {"input_ids": PROMPT, **field}))
    name = next(iter(field["sampling_params"])) if "sampling_params" in field else next(iter(field))
    assert status == 400 and name in answer["error"]["message"]


# ---- incremental detokenization ---------------------------------------------------------------


def byte_level_tokenizer() -> Any:
    """A byte-level BPE with few merges: "é" and "世" are several tokens each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, the cat sat on the mat"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_incremental_text_never_splits_a_character() -> None:
    tokenizer = byte_level_tokenizer()
    text = "héllo 世界, the cat ✓ sat"
    ids = tokenizer.encode(text)
    assert len(tokenizer.encode("世")) == 3 and len(tokenizer.encode("é")) == 2
    stream = IncrementalText(tokenizer.decode)
    seen = [stream.update(ids[: i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in s for s in seen)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))
    assert seen[-1] == text


def test_incremental_text_holds_back_what_may_begin_a_stop() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("the cat END")
    stream = IncrementalText(tokenizer.decode, stops=["ENDX"])
    texts = [stream.update(ids[: i + 1]) for i in range(len(ids))]
    assert texts[-1] == "the cat "  # "END" may begin the stop "ENDX"
    assert (
        IncrementalText(tokenizer.decode, stops=["ENDX"]).update(tokenizer.encode("the cat ENDs"))
        == "the cat ENDs"
    )


def test_a_chunk_shows_only_the_steps_the_serving_loop_has_seen(server: Server) -> None:
    """The consumer reads a request's tokens while the next step runs: it takes only those of
    the steps the loop has seen (`poke`), never the token of a step still running, which may
    end the request (a stop string the final text is cut before)."""
    scheduler = server.serving.scheduler  # driven directly: the server is idle
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    request = GenerateRequest(list(PROMPT), params, rid="seen", top_logprobs_num=2)
    handle = scheduler.submit(request)
    try:
        scheduler.step()
        scheduler.step()
        state = StreamState(request, DetokenizeParams(), server.serving.results)
        state.poke(len(handle.output_ids))
        assert state.ready.is_set() and state.generated == 2
        scheduler.step()  # a token the loop has not seen
        new = handle.output_since(0, 0, end=state.generated, with_input=state.wants_input)
        state.pull(new)
        meta = state.chunk("0").meta_info
        assert state.ids == handle.output_ids[:2] and not state.ready.is_set()
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 2
        assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]
        assert meta["input_top_logprobs"] == [None] and not state.wants_input
        state.poke(3)  # below stream_interval 1 past the chunk taken: due
        assert state.ready.is_set()
    finally:
        scheduler.abort(request.rid, exact=True)


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_result_shaper_decodes_as_the_tokenizer_does(clean_up: bool) -> None:
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    tokenizer.clean_up_tokenization_spaces = clean_up
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    ids = tokenizer.encode("héllo world , the cat ✓ sat .") + [end] + tokenizer.encode(" on")
    shaper = ResultShaper(tokenizer)
    for skip in (True, False):
        opts = DetokenizeParams(skip_special_tokens=skip)
        for cut in (ids, ids[:3], ids[2:], [end]):
            assert shaper.decode(cut, opts) == tokenizer.decode(cut, skip_special_tokens=skip)
