"""Engine metrics through their real interfaces: `GET /metrics` of a verst server on loopback,
parsed by prometheus_client's own parser, against the requests the test made; one registry per
engine; the trainer's `engine/*` sampler over an embedded scheduler."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.servers import Engine, LoopThread, call, start_engine, tiny_model  # noqa: E402
from verst.engine import GenerateRequest, SamplingParams  # noqa: E402
from verst.fleet import HttpEngineClient  # noqa: E402
from verst.monitor.engine_stats import EngineSampler, sample_values  # noqa: E402

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture
def engine(loop: LoopThread, model_dir: Path) -> Iterator[Engine]:
    served = loop.run(start_engine(model_dir))
    yield served
    loop.run(served.runner.cleanup())


def scrape(loop: LoopThread, url: str) -> dict[str, dict]:
    """GET /metrics parsed: family name -> {sample name: value}, and each family's labels."""

    async def get() -> tuple[int, str, str]:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as response:
                return response.status, response.content_type, await response.text()

    status, content_type, text = loop.run(get())
    assert status == 200 and content_type == "text/plain"
    families = list(text_string_to_metric_families(text))
    for family in families:
        assert {s.labels.get("model_name") for s in family.samples} == {"tiny"}, family.name
    return {"values": sample_values(families), "types": {f.name: f.type for f in families}}


def generate(loop: LoopThread, url: str, prompt: list[int], max_new_tokens: int) -> dict:
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}
    status, body = loop.run(
        call(url, "/generate", {"input_ids": prompt, "sampling_params": params})
    )
    assert status == 200, body
    return body["meta_info"]


def test_metrics_count_the_requests_made(loop: LoopThread, engine: Engine) -> None:
    before = scrape(loop, engine.url)["values"]
    assert before["sglang:num_requests_total"] == 0
    assert before["sglang:max_total_num_tokens"] > 0 and before["sglang:token_usage"] == 0
    metas = [generate(loop, engine.url, PROMPT, n) for n in (1, 3, 6)]
    metas.append(generate(loop, engine.url, PROMPT, 4))  # the same prompt: a prefix-cache hit
    metrics = scrape(loop, engine.url)
    values, types = metrics["values"], metrics["types"]
    assert types["sglang:generation_tokens"] == "counter"
    assert types["sglang:time_to_first_token_seconds"] == "histogram"
    assert values["sglang:num_requests_total"] == 4
    assert values["sglang:num_aborted_requests_total"] == 0
    assert values["sglang:generation_tokens_total"] == sum(m["completion_tokens"] for m in metas)
    assert values["sglang:prompt_tokens_total"] == sum(m["prompt_tokens"] for m in metas)
    assert values["sglang:cached_tokens_total"] == sum(m["cached_tokens"] for m in metas) > 0
    assert values["verst:prefix_cache_hit_tokens_total"] > 0
    assert 0 < values["sglang:cache_hit_rate"] <= 1
    for name in ("sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds"):
        assert values[f"{name}_count"] == 4, name
    # the first token comes before the answer; the e2e sum is at most the wall time of the calls
    e2e_sum = values["sglang:e2e_request_latency_seconds_sum"]
    assert 0 < values["sglang:time_to_first_token_seconds_sum"] < e2e_sum
    assert e2e_sum <= sum(m["e2e_latency"] for m in metas) + 0.1
    # requests of 2+ tokens have an inter-token latency
    assert values["verst:request_inter_token_latency_seconds_count"] == 3
    assert values["sglang:num_running_reqs"] == values["sglang:num_queue_reqs"] == 0
    assert values["sglang:gen_throughput"] > 0
    assert values["verst:scheduler_requests_total"] == 4
    assert values["verst:weight_version"] == 0
    status, _ = loop.run(call(engine.url, "/update_weight_version", {"new_version": "7"}))
    assert status == 200
    assert scrape(loop, engine.url)["values"]["verst:weight_version"] == 7


def test_aborted_requests_are_counted_and_timed(loop: LoopThread, engine: Engine) -> None:
    scheduler = engine.serving.scheduler
    opened = threading.Event()
    real_step = scheduler.step
    # hold the scheduler's steps so the request is in the engine, unanswered, when aborted
    scheduler.step = lambda: (opened.wait(10), real_step())[1]  # type: ignore[method-assign]
    try:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}}
        pending = loop.submit(call(engine.url, "/generate", body))
        deadline = time.monotonic() + 10
        while not engine.serving.load()["num_running_reqs"] and time.monotonic() < deadline:
            time.sleep(0.005)
        status, _ = loop.run(call(engine.url, "/abort_request", {"abort_all": True}))
        status_aborted, answer = pending.result(timeout=10)
    finally:
        opened.set()
        del scheduler.step  # the class's own again
    assert status == status_aborted == 200
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    values = scrape(loop, engine.url)["values"]
    assert values["sglang:num_requests_total"] == values["sglang:num_aborted_requests_total"] == 1
    assert values["sglang:e2e_request_latency_seconds_count"] == 1
    assert values["sglang:time_to_first_token_seconds_count"] == 0  # it never made a token


def test_each_engine_has_a_registry_of_its_own(
    loop: LoopThread, engine: Engine, model_dir: Path
) -> None:
    other = loop.run(start_engine(model_dir))
    try:
        generate(loop, engine.url, PROMPT, 2)
        client = HttpEngineClient(other.url)
        families = loop.run(client.metric_families())
        loop.run(client.close())
        assert sample_values(families)["sglang:num_requests_total"] == 0
        assert scrape(loop, engine.url)["values"]["sglang:num_requests_total"] == 1
    finally:
        loop.run(other.runner.cleanup())


def test_the_sampler_reports_each_steps_increase(loop: LoopThread, engine: Engine) -> None:
    scheduler = engine.serving.scheduler
    sampler = EngineSampler.for_engine(scheduler, None)
    sampler.sample()  # what the server did before this test is not this step's
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    outputs = scheduler.generate([GenerateRequest(list(PROMPT), params) for _ in range(3)])
    step = sampler.sample()
    assert step["engine/generation_tokens"] == 15 == sum(o.completion_tokens for o in outputs)
    assert step["engine/prompt_tokens"] == 3 * len(PROMPT)
    assert step["engine/scheduler_requests"] == 3
    assert step["engine/generation_tokens_per_s"] > 0 and 0 < step["engine/busy_fraction"] <= 1
    assert step["engine/sampled_engines"] == 1 and step["engine/num_running_reqs"] == 0
    idle = sampler.sample()
    assert idle["engine/generation_tokens"] == 0 and "engine/cache_hit_rate" not in idle
