"""The serving layer through its real interfaces: an aiohttp server on 127.0.0.1 speaking SGLang's
protocol, the HTTP and in-process `EngineClient`s (same assertions, same dicts), batching,
abort / pause / continue, disk weight updates, the OpenAI routes and the subprocess launcher."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

from tests.servers import (  # noqa: E402
    STEP_TIMEOUT_S,
    LoopThread,
    T,
    new_serving,
    serve_engine,
    tiny_model,
)
from verst.engine import GenerateRequest, SamplingParams  # noqa: E402
from verst.engine.serving import ServingEngine  # noqa: E402
from verst.fleet import (  # noqa: E402
    EngineClient,
    EngineError,
    HttpEngineClient,
    InProcessEngineClient,
    launch_local_engines,
    launch_sglang,
)

PROMPT = [40, 41, 42, 43]
GREEDY = {"max_new_tokens": 8, "temperature": 0}


@dataclass
class Server:
    loop: LoopThread
    serving: ServingEngine
    url: str
    model_a: Path
    model_b: Path

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run(coro)

    def reference(self, prompt: list[int], **params: Any) -> Any:
        """What `Engine.generate` itself returns (called only while the server is idle)."""
        request = GenerateRequest(list(prompt), SamplingParams(**params), rid="ref")
        return self.serving.scheduler.generate([request])[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("models")
    model_a = tiny_model(root, "a", seed=0)
    model_b = tiny_model(root, "b", seed=1)
    loop = LoopThread()
    serving = new_serving(model_a)
    engine = loop.run(serve_engine(serving))
    yield Server(loop, serving, engine.url, model_a, model_b)
    loop.run(engine.runner.cleanup())
    loop.close()


@pytest.fixture(params=["http", "inprocess"])
def client(request: pytest.FixtureRequest, server: Server) -> Iterator[EngineClient]:
    engine_client: EngineClient
    if request.param == "http":
        engine_client = HttpEngineClient(server.url)
    else:
        engine_client = InProcessEngineClient(server.serving)
    yield engine_client
    server.run(engine_client.close())


async def raw(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any, str]:
    """One plain HTTP call: (status, parsed JSON or None, content type)."""
    data = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
    async with aiohttp.ClientSession() as session:
        async with session.request(method, server.url + path, data=data) as response:
            text = await response.text()
            try:
                parsed = json.loads(text) if text else None
            except ValueError:
                parsed = None
            return response.status, parsed, response.content_type


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


class Gate:
    """Holds the scheduler's steps until opened, so a test can see requests queued / running."""

    def __init__(self, serving: ServingEngine) -> None:
        self.serving = serving
        self.event = threading.Event()
        self.real = serving.scheduler.step

    def __enter__(self) -> Gate:
        def gated() -> Any:
            self.event.wait(STEP_TIMEOUT_S)
            return self.real()

        self.serving.scheduler.step = gated  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.event.set()
        del self.serving.scheduler.step


def check_meta(meta: dict[str, Any], *, logprobs: bool) -> None:
    assert isinstance(meta["id"], str)
    assert isinstance(meta["weight_version"], str)
    assert isinstance(meta["cached_tokens"], int) and meta["cached_tokens"] >= 0
    assert isinstance(meta["e2e_latency"], float)
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    if logprobs:
        triples = meta["output_token_logprobs"]
        assert len(triples) == meta["completion_tokens"]
        for lp, token_id, text in triples:
            assert isinstance(lp, float) and isinstance(token_id, int) and text is None


# ---- /generate -------------------------------------------------------------------------------


def test_greedy_generate_equals_engine(server: Server, client: EngineClient) -> None:
    ref = server.reference(PROMPT, max_new_tokens=8, temperature=0.0)
    out = server.run(
        client.generate(
            {"input_ids": PROMPT, "sampling_params": GREEDY, "rid": "g1", "return_logprob": True}
        )
    )
    assert isinstance(out, dict)
    assert out["output_ids"] == ref.output_ids
    assert out["text"] == server.serving.tokenizer.decode(ref.output_ids, skip_special_tokens=True)
    meta = out["meta_info"]
    check_meta(meta, logprobs=True)
    assert meta["id"] == "g1"
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert [t[0] for t in meta["output_token_logprobs"]] == pytest.approx(
        ref.output_token_logprobs, abs=1e-5
    )
    # A stop token ends the request and is reported as matched (and kept in output_ids).
    first = ref.output_ids[0]
    params = {**GREEDY, "stop_token_ids": [first]}
    stopped = server.run(client.generate({"input_ids": PROMPT, "sampling_params": params}))
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert "output_token_logprobs" not in stopped["meta_info"]


def test_text_batch_and_n_are_prompt_major(server: Server, client: EngineClient) -> None:
    tokenizer = server.serving.tokenizer
    by_text = server.run(client.generate({"text": "hello", "sampling_params": GREEDY}))
    by_ids = server.run(
        client.generate({"input_ids": tokenizer.encode("hello"), "sampling_params": GREEDY})
    )
    assert by_text["output_ids"] == by_ids["output_ids"]

    prompts = [PROMPT, [50, 51], [60, 61, 62, 63, 64, 65]]
    batch = server.run(
        client.generate({"input_ids": prompts, "sampling_params": GREEDY, "rid": "b"})
    )
    assert isinstance(batch, list) and len(batch) == 3
    assert [r["meta_info"]["id"] for r in batch] == ["b_0", "b_1", "b_2"]
    for prompt, result in zip(prompts, batch, strict=True):
        assert result["output_ids"] == server.reference(prompt, **GREEDY).output_ids

    sampled = {"max_new_tokens": 4, "temperature": 1.0, "min_p": 0.05, "n": 2}
    many = server.run(client.generate({"input_ids": prompts, "sampling_params": sampled}))
    assert len(many) == 6
    assert [r["meta_info"]["prompt_tokens"] for r in many] == [4, 4, 2, 2, 6, 6]
    single_n = server.run(client.generate({"input_ids": PROMPT, "sampling_params": sampled}))
    assert isinstance(single_n, list) and len(single_n) == 2


def test_stop_strings_cut_text_and_ids(server: Server, client: EngineClient) -> None:
    ref = server.reference(PROMPT, **GREEDY)
    text = server.serving.tokenizer.decode(ref.output_ids)  # one char per token
    stop = text[3:5]
    pos = text.find(stop)
    params = {**GREEDY, "stop": [stop, "never-there"]}
    out = server.run(client.generate({"input_ids": PROMPT, "sampling_params": params}))
    assert out["text"] == text[:pos]
    assert out["output_ids"] == ref.output_ids[: pos + len(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = {**params, "no_stop_trim": True}
    out = server.run(client.generate({"input_ids": PROMPT, "sampling_params": kept}))
    assert out["text"] == text[: pos + len(stop)]


def test_bad_requests_use_sglang_envelopes(server: Server, client: EngineClient) -> None:
    with pytest.raises(EngineError) as error:
        payload = {"input_ids": PROMPT, "sampling_params": {"seed": 3}}
        server.run(client.generate(payload))
    assert error.value.status == 400
    assert isinstance(error.value.body["error"], str) and "seed" in error.value.body["error"]
    with pytest.raises(EngineError) as error:
        server.run(client.generate({"input_ids": []}))
    assert error.value.status == 400 and "message" in error.value.body["error"]
    with pytest.raises(EngineError) as error:
        server.run(client.generate({"input_ids": [1] * 200, "sampling_params": GREEDY}))
    assert error.value.status == 400 and "context length" in error.value.body["error"]["message"]

    status, body, _ = server.run(raw(server, "POST", "/generate", "{not json"))
    assert status == 400
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request"


def test_fifty_concurrent_requests_complete_in_few_batches(server: Server) -> None:
    async def burst() -> list[Any]:
        client = HttpEngineClient(server.url)
        try:
            payloads = [
                {"input_ids": [10 + i % 7, 20], "sampling_params": {"max_new_tokens": 4}}
                for i in range(50)
            ]
            return await asyncio.gather(*(client.generate(p) for p in payloads))
        finally:
            await client.close()

    before = server.serving.num_batches
    results = server.run(burst())
    assert len(results) == 50
    assert all(r["meta_info"]["completion_tokens"] >= 1 for r in results)
    assert server.serving.num_batches - before < 50


# ---- abort, pause, flush ---------------------------------------------------------------------


def test_abort_queued_request_by_rid_prefix(server: Server, client: EngineClient) -> None:
    serving = server.serving

    async def scenario() -> tuple[Any, Any]:
        with Gate(serving) as gate:
            blocker = asyncio.ensure_future(
                client.generate({"input_ids": PROMPT, "sampling_params": GREEDY, "rid": "blk"})
            )
            await wait_until(lambda: serving.load()["num_running_reqs"] == 1)
            victim = asyncio.ensure_future(
                client.generate({"input_ids": PROMPT, "sampling_params": GREEDY, "rid": "vic-7"})
            )
            await wait_until(lambda: serving.load()["num_waiting_reqs"] == 1)
            await client.abort_request("vic")
            aborted = await victim
            gate.event.set()
            return aborted, await blocker

    aborted, finished = server.run(scenario())
    reason = aborted["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] is None and reason["message"]
    assert aborted["meta_info"]["id"] == "vic-7" and aborted["output_ids"] == []
    assert finished["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_abort_then_waiting_request_runs_after_continue(
    server: Server, client: EngineClient
) -> None:
    serving = server.serving

    async def scenario() -> tuple[list[Any], bool, Any]:
        with Gate(serving) as gate:
            running = asyncio.ensure_future(
                client.generate({"input_ids": PROMPT, "sampling_params": GREEDY})
            )
            await wait_until(lambda: serving.load()["num_running_reqs"] == 1)
            queued = asyncio.ensure_future(
                client.generate({"input_ids": [7, 8], "sampling_params": GREEDY})
            )
            await wait_until(lambda: serving.load()["num_waiting_reqs"] == 1)
            await client.pause_generation("abort")
            aborted = list(await asyncio.gather(running, queued))
            gate.event.set()
            # While paused a new request waits instead of being rejected.
            later = asyncio.ensure_future(
                client.generate({"input_ids": PROMPT, "sampling_params": GREEDY})
            )
            await asyncio.sleep(0.2)
            waited = not later.done()
            await client.continue_generation()
            return aborted, waited, await later

    aborted, waited, later = server.run(scenario())
    assert [r["meta_info"]["finish_reason"]["type"] for r in aborted] == ["abort", "abort"]
    assert waited
    assert later["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_flush_cache(server: Server, client: EngineClient) -> None:
    assert server.run(client.flush_cache()) is True
    status, _, content_type = server.run(raw(server, "POST", "/flush_cache"))
    assert (status, content_type) == (200, "text/plain")

    async def busy() -> tuple[bool, int]:
        with Gate(server.serving) as gate:
            task = asyncio.ensure_future(
                client.generate({"input_ids": PROMPT, "sampling_params": GREEDY})
            )
            await wait_until(lambda: server.serving.load()["num_running_reqs"] == 1)
            flushed = await client.flush_cache()
            status, _, _ = await raw(server, "POST", "/flush_cache")
            gate.event.set()
            await task
            return flushed, status

    assert server.run(busy()) == (False, 400)


# ---- weights ---------------------------------------------------------------------------------


def test_update_weights_from_disk_switches_outputs(server: Server, client: EngineClient) -> None:
    # Random tiny models often repeat one token, so compare log-probs as well as ids.
    payload = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    before = server.run(client.generate(payload))
    body = server.run(client.update_weights_from_disk(str(server.model_b), "v2"))
    assert body["success"] is True
    try:
        after = server.run(client.generate(payload))
        assert (after["output_ids"], after["meta_info"]["output_token_logprobs"]) != (
            before["output_ids"],
            before["meta_info"]["output_token_logprobs"],
        )
        assert after["meta_info"]["weight_version"] == "v2"
        assert server.run(client.get_weight_version()) == "v2"
        with pytest.raises(EngineError) as error:
            server.run(client.update_weights_from_disk(str(server.model_a / "missing")))
        assert error.value.status == 400 and error.value.body["success"] is False
    finally:
        server.run(client.update_weights_from_disk(str(server.model_a), "0"))
    restored = server.run(client.generate(payload))
    assert restored["output_ids"] == before["output_ids"]
    assert (
        restored["meta_info"]["output_token_logprobs"]
        == before["meta_info"]["output_token_logprobs"]
    )
    assert restored["meta_info"]["weight_version"] == "0"


def test_update_weight_version_endpoint(server: Server) -> None:
    status, body, _ = server.run(
        raw(server, "POST", "/update_weight_version", {"new_version": "5"})
    )
    assert status == 200 and body == {
        "success": True,
        "message": "Weight version updated to 5",
        "new_version": "5",
    }
    assert server.run(raw(server, "GET", "/get_weight_version"))[1] == {"weight_version": "5"}
    server.run(raw(server, "POST", "/update_weight_version", {"new_version": "0"}))


# ---- info, health, OpenAI --------------------------------------------------------------------


def test_info_and_health_endpoints(server: Server, client: EngineClient) -> None:
    assert server.run(client.health()) is True
    load = server.run(client.get_load())
    assert load["loads"][0]["num_running_reqs"] == 0 and "num_waiting_reqs" in load["loads"][0]
    for path in ("/health", "/health_generate"):
        assert server.run(raw(server, "GET", path))[0] == 200
    for path in ("/model_info", "/get_model_info"):
        status, body, _ = server.run(raw(server, "GET", path))
        assert status == 200 and isinstance(body["weight_version"], str)
        assert body["served_model_name"] == "tiny" and body["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        status, body, _ = server.run(raw(server, "GET", path))
        assert status == 200 and body["dp_size"] == 1
        assert {"num_running_reqs", "num_waiting_reqs"} <= body.keys()


def test_openai_chat_and_completions(server: Server) -> None:
    tokenizer = server.serving.tokenizer
    messages = [{"role": "user", "content": "hi there"}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    status, body, _ = server.run(raw(server, "POST", "/v1/chat/completions", chat))
    assert status == 200 and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ref = server.reference(prompt_ids, max_new_tokens=6, temperature=0.0)
    expected = tokenizer.decode(
        ref.output_ids[:-1] if ref.finish_reason == "stop" else ref.output_ids,
        skip_special_tokens=True,
    )
    assert choice["message"]["content"] == expected
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ref.output_ids),
        "total_tokens": len(prompt_ids) + len(ref.output_ids),
    }

    completion = {"prompt": "abc", "max_tokens": 5, "n": 2, "logprobs": 0}
    status, body, _ = server.run(raw(server, "POST", "/v1/completions", completion))
    assert status == 200 and body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) <= 5
    assert body["usage"]["prompt_tokens"] == 3

    async def stream() -> list[str]:
        async with aiohttp.ClientSession() as session:
            payload = {**chat, "stream": True}
            async with session.post(server.url + "/v1/chat/completions", json=payload) as r:
                assert r.content_type == "text/event-stream"
                return [line for line in (await r.text()).split("\n\n") if line]

    events = server.run(stream())
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == expected
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    status, body, _ = server.run(
        raw(server, "POST", "/v1/completions", {"prompt": "a", "presence_penalty": 2.5})
    )
    assert status == 400 and body["object"] == "error"
    assert "presence_penalty must be in [-2, 2]" in body["message"]


def test_generate_stream_ends_with_done(server: Server) -> None:
    async def stream() -> list[str]:
        async with aiohttp.ClientSession() as session:
            payload = {"input_ids": PROMPT, "sampling_params": GREEDY, "stream": True}
            async with session.post(server.url + "/generate", json=payload) as r:
                return [line for line in (await r.text()).split("\n\n") if line]

    events = server.run(stream())
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["output_ids"] == server.reference(PROMPT, **GREEDY).output_ids


# ---- launcher --------------------------------------------------------------------------------


def test_launcher_starts_verst_serve(server: Server) -> None:
    (engine,) = launch_local_engines(server.model_a, 1, timeout_s=60)
    with engine:
        with urllib.request.urlopen(engine.url + "/health", timeout=5) as response:
            assert response.status == 200
    assert engine.process.poll() is not None


def test_an_engine_process_stops_when_its_launcher_dies(server: Server) -> None:
    """A training run killed without cleanup must not leave its engine servers running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys\n"
        "from verst.fleet import launch_local_engines\n"
        f"(engine,) = launch_local_engines({str(server.model_a)!r}, 1, timeout_s=60)\n"
        "print(engine.process.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    engine_pid = int(launcher.stdout.readline())
    launcher.send_signal(signal.SIGKILL)  # no cleanup runs in the launcher
    launcher.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(engine_pid, signal.SIGKILL)
    pytest.fail("the engine process outlived its launcher by 20 s")


def test_launch_sglang_without_sglang_is_a_clear_error() -> None:
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed")
    with pytest.raises(RuntimeError, match=r"pip install \"sglang\[all\]\""):
        launch_sglang("/nonexistent", 30000)


# ---- scheduler features through the protocol -------------------------------------------------


def test_prefix_cache_seeds_and_prompt_scoring(server: Server, client: EngineClient) -> None:
    long_prompt = list(range(30, 70))  # 40 tokens: whole pages to share

    async def scenario() -> tuple[Any, Any, Any, Any, Any]:
        first = await client.generate({"input_ids": long_prompt, "sampling_params": GREEDY})
        again = await client.generate({"input_ids": long_prompt, "sampling_params": GREEDY})
        seeded = {"max_new_tokens": 6, "sampling_seed": 5}
        a = await client.generate({"input_ids": PROMPT, "sampling_params": seeded})
        b = await client.generate({"input_ids": PROMPT, "sampling_params": seeded})
        scored = await client.generate(
            {
                "input_ids": long_prompt,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0},
            }
        )
        return first, again, a, b, scored

    first, again, a, b, scored = server.run(scenario())
    assert again["meta_info"]["cached_tokens"] >= 32  # whole pages of the shared prompt
    assert again["output_ids"] == first["output_ids"]
    assert a["output_ids"] == b["output_ids"]  # same seed, same sample
    triples = scored["meta_info"]["input_token_logprobs"]
    assert len(triples) == len(long_prompt) and triples[0][0] is None
    assert [t[1] for t in triples] == long_prompt
    assert all(t[0] <= 0.0 for t in triples[1:])
    assert scored["output_ids"] == []


def test_version_spans() -> None:
    from verst.engine.results import version_spans

    assert version_spans([]) == []
    assert version_spans([3, 3, 4]) == [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": 3},
    ]


def test_context_length_is_the_models_positions_windowed_or_not() -> None:
    # the engine applies sliding windows in attention, so a window does not bound the context
    import transformers

    from verst.engine.serving import context_length

    mistral = transformers.MistralConfig(sliding_window=4096)
    assert context_length(mistral) == mistral.max_position_embeddings > 4096
    windowed = transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=1024, max_window_layers=0
    )
    assert context_length(windowed) == 32768
    assert context_length(transformers.LlamaConfig(max_position_embeddings=2048)) == 2048
    assert context_length(None) == 0
