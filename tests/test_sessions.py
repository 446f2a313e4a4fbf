"""Sessions: assembly of turn records into Samples (masks, log-prob alignment, per-turn weight
versions, truncation on a turn boundary, inconsistent records), and the session server in front
of a real tiny engine on 127.0.0.1 (directly and behind the router): multi-turn conversations
through aiohttp and the official `openai` client, the append-only rule, rollback, errors."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Iterator
from dataclasses import astuple, dataclass
from typing import Any

import pytest
import torch

from verst.sessions.assembly import AssemblyError, TurnRecord, assemble
from verst.types import Status

# ---- assembly --------------------------------------------------------------------------------


def three_turns() -> list[TurnRecord]:
    """prompt [1,2,3] → out [10,11] → tool [4,5] → out [12] → user [6] → out [13,14,15]."""
    return [
        TurnRecord([1, 2, 3], [10, 11], [-0.1, -0.2], 0, "stop"),
        TurnRecord([1, 2, 3, 10, 11, 4, 5], [12], [-0.3], "1", "stop"),
        TurnRecord([1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14, 15], [-0.4, -0.5, -0.6], 2, "stop"),
    ]


def test_assembly_masks_logprobs_versions() -> None:
    sample = assemble(three_turns())
    assert sample.tokens == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14, 15]
    assert sample.prompt_tokens == [1, 2, 3] and sample.response_length == 9
    assert sample.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert sample.rollout_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5, -0.6]
    assert sample.weight_versions == [0, 1, 2]
    assert sample.status is Status.COMPLETED
    sampled = [t for t, m in zip(sample.response_tokens, sample.loss_mask, strict=True) if m]
    assert sampled == [10, 11, 12, 13, 14, 15]


def test_assembly_status_from_last_turn() -> None:
    records = three_turns()
    last = records[-1]
    records[-1] = TurnRecord(last.input_ids, last.output_ids, last.output_logprobs, 2, "length")
    assert assemble(records).status is Status.TRUNCATED
    records[-1] = TurnRecord(last.input_ids, last.output_ids, last.output_logprobs, 2, "abort")
    assert assemble(records).status is Status.ABORTED
    # A length-cut earlier turn does not make the session truncated.
    first = records[0]
    records[0] = TurnRecord(first.input_ids, first.output_ids, first.output_logprobs, 0, "length")
    records[-1] = last
    assert assemble(records).status is Status.COMPLETED


def test_truncation_on_turn_boundary() -> None:
    records = three_turns()
    assert assemble(records, max_seq_len=12).status is Status.COMPLETED  # fits exactly
    sample = assemble(records, max_seq_len=11)  # the last turn (12 ids) is dropped whole
    assert sample.tokens == [1, 2, 3, 10, 11, 4, 5, 12]
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.weight_versions == [0, 1]
    assert sample.status is Status.TRUNCATED
    assert sample.metadata["dropped_turns"] == 1
    sample = assemble(records, max_seq_len=7)
    assert sample.tokens == [1, 2, 3, 10, 11] and sample.weight_versions == [0]
    assert sample.status is Status.TRUNCATED


def test_truncation_inside_a_too_long_first_turn() -> None:
    sample = assemble(three_turns(), max_seq_len=4)
    assert sample.tokens == [1, 2, 3, 10] and sample.loss_mask == [1]
    assert sample.rollout_logprobs == [-0.1] and sample.status is Status.TRUNCATED
    with pytest.raises(AssemblyError, match="prompt alone"):
        assemble(three_turns(), max_seq_len=3)


def test_the_last_kept_turn_gives_the_routed_experts() -> None:
    """Each turn's record covers all its fed positions (its prompt holds the turns before):
    the sample takes the last kept turn's, cut to the kept tokens."""
    records = three_turns()
    for i, r in enumerate(records):
        rows = torch.arange(len(r.total_ids) - 1, dtype=torch.int32) * 10 + i  # [rows, 1]
        records[i] = TurnRecord(*astuple(r)[:5], rows[:, None].expand(-1, 2).contiguous())
    whole = assemble(records)
    assert torch.equal(whole.routed_experts, records[2].routed_experts)  # 11 rows of 12 tokens
    dropped = assemble(records, max_seq_len=11)  # the last turn dropped: turn 1's record
    assert torch.equal(dropped.routed_experts, records[1].routed_experts)
    cut = assemble(records, max_seq_len=4)  # inside the first turn: its rows cut to 3
    assert torch.equal(cut.routed_experts, records[0].routed_experts[:3])
    records[2] = TurnRecord(*astuple(records[2])[:5], records[2].routed_experts[:5])
    with pytest.raises(AssemblyError, match="cover 5 positions, the session has 11"):
        assemble(records)


def test_inconsistent_records_raise() -> None:
    with pytest.raises(AssemblyError, match="no turns"):
        assemble([])
    records = three_turns()
    records[1] = TurnRecord([1, 2, 3, 10, 99, 4, 5], [12], [-0.3], 1, "stop")
    with pytest.raises(AssemblyError, match="position 4"):
        assemble(records)
    with pytest.raises(AssemblyError, match="log-probs"):
        assemble([TurnRecord([1], [2, 3], [-0.1], 0, "stop")])
    with pytest.raises(AssemblyError, match="not an integer"):
        assemble([TurnRecord([1], [2], [-0.1], "v-final", "stop")])


# ---- the session server over a real tiny engine ----------------------------------------------

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from tests.servers import (  # noqa: E402
    LoopThread,
    T,
    call,
    new_serving,
    serve_engine,
    start_app,
    tiny_config,
    tiny_model,
)
from verst.engine.serving import ServingEngine  # noqa: E402
from verst.router import Router  # noqa: E402
from verst.router.server import make_router_app  # noqa: E402
from verst.sessions import ChatTokenizer  # noqa: E402
from verst.sessions.server import make_session_app  # noqa: E402
from verst.sessions.store import SessionStore  # noqa: E402

TINY = tiny_config(max_position_embeddings=512)


@dataclass
class Stack:
    """Engine ← router (sessions on) ← session server; `seen` is every (input_ids, output_ids)
    the engine itself received and produced."""

    loop: LoopThread
    serving: ServingEngine
    engine_url: str
    router: Router
    router_url: str
    store: SessionStore
    url: str
    chat_tokenizer: ChatTokenizer
    seen: list[tuple[list[int], list[int]]]

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run(coro)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir = tiny_model(tmp_path_factory.mktemp("models"), config=TINY)
    loop = LoopThread()
    seen: list[tuple[list[int], list[int]]] = []

    async def setup() -> tuple[Any, ...]:
        serving = new_serving(model_dir)
        real_generate = serving.generate

        async def spy(input_ids: list[int], *args: Any, **kwargs: Any) -> Any:
            result = await real_generate(input_ids, *args, **kwargs)
            seen.append((list(input_ids), list(result.output_ids)))
            return result

        serving.generate = spy  # type: ignore[method-assign]
        engine = await serve_engine(serving)
        router = Router([engine.url], sessions=True)
        routed = await start_app(make_router_app(router, health_interval_s=0.2))
        chat_tokenizer = ChatTokenizer(serving.tokenizer)
        store = SessionStore(chat_tokenizer)
        app = make_session_app(routed[1], chat_tokenizer, model_name="tiny", store=store)
        sessions = await start_app(app)
        return serving, engine, router, routed, store, sessions, chat_tokenizer

    serving, engine, router, routed, store, sessions, ct = loop.run(setup())
    yield Stack(loop, serving, engine.url, router, routed[1], store, sessions[1], ct, seen)
    for runner in (sessions[0], routed[0], engine.runner):
        loop.run(runner.cleanup())
    loop.close()


def new_session(stack: Stack) -> str:
    status, body = stack.run(call(stack.url, "/sessions"))
    assert status == 200
    return body["session_id"]


def chat(stack: Stack, sid: str, messages: list[dict[str, Any]], **extra: Any) -> tuple[int, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, **extra}
    return stack.run(call(stack.url, f"/sessions/{sid}/v1/chat/completions", body))


def converse(stack: Stack, sid: str) -> list[dict[str, Any]]:
    """user → assistant → tool → assistant → user → assistant; returns the full history."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    for follow_up in (
        {"role": "tool", "content": "calculator: 5"},
        {"role": "user", "content": "And 5+7?"},
        None,
    ):
        status, reply = chat(stack, sid, messages)
        assert status == 200, reply
        message = reply["choices"][0]["message"]
        assert message["role"] == "assistant" and isinstance(message["content"], str)
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
        messages.append({"role": "assistant", "content": message["content"]})
        if follow_up is not None:
            messages.append(follow_up)
    return messages


def test_three_turns_assemble_to_exactly_what_the_engine_saw(stack: Stack) -> None:
    sid = new_session(stack)
    before = len(stack.seen)
    messages = converse(stack, sid)
    seen = stack.seen[before:]
    records = stack.store.get(sid).records
    assert len(seen) == len(records) == 3
    for (input_ids, output_ids), record in zip(seen, records, strict=True):
        assert record.input_ids == input_ids and record.output_ids == output_ids
    for earlier, later in zip(seen, seen[1:], strict=False):
        assert later[0][: len(earlier[0]) + len(earlier[1])] == earlier[0] + earlier[1]

    sample = stack.store.assemble(sid)
    assert sample.tokens == seen[-1][0] + seen[-1][1]
    assert sample.prompt_tokens == seen[0][0]
    assert sample.weight_versions == [0, 0, 0]
    # Mask 1 exactly on the sampled ids, 0 on the tool / user suffixes between them.
    response = sample.response_tokens
    sampled = [t for t, m in zip(response, sample.loss_mask, strict=True) if m]
    assert sampled == [t for _, out in seen for t in out]
    ct = stack.chat_tokenizer
    written = ct.tokenizer.decode(
        [t for t, m in zip(response, sample.loss_mask, strict=True) if not m]
    )
    assert "calculator: 5" in written and "And 5+7?" in written
    masked_lp = [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True)]
    assert all(lp == 0.0 for lp, m in zip(masked_lp, sample.loss_mask, strict=True) if not m)
    assert [lp for lp, m in zip(masked_lp, sample.loss_mask, strict=True) if m] == [
        lp for r in records for lp in r.output_logprobs
    ]
    # The char tokenizer's ChatML template is append-only: nothing differs from a re-render
    # unless the random model sampled a special token inside an answer.
    specials = ct.special_ids - {ct.format.end_of_turn_id}
    if not any(t in specials for _, out in seen for t in out):
        assert set(sample.metadata["mismatch"].values()) == {0}

    status, body = stack.run(call(stack.url, f"/sessions/{sid}/samples", {"max_seq_len": None}))
    assert status == 200
    assert body["tokens"] == sample.tokens and body["loss_mask"] == sample.loss_mask
    assert body["rollout_logprobs"] == sample.rollout_logprobs
    assert body["status"] == sample.status.value and body["weight_versions"] == [0, 0, 0]
    assert body["mismatch"] == sample.metadata["mismatch"]

    # Truncation on a turn boundary: room for two turns only.
    limit = len(seen[1][0]) + len(seen[1][1])
    status, body = stack.run(call(stack.url, f"/sessions/{sid}/samples", {"max_seq_len": limit}))
    assert status == 200 and body["status"] == "truncated"
    assert body["tokens"] == seen[1][0] + seen[1][1] and body["weight_versions"] == [0, 0]

    status, summary = stack.run(call(stack.url, f"/sessions/{sid}", method="GET"))
    assert status == 200 and summary["num_turns"] == 3
    assert summary["messages"][: len(messages)] == [
        {**m, "content": m["content"]} for m in messages
    ]


def test_history_is_append_only_with_one_rollback(stack: Stack) -> None:
    sid = new_session(stack)
    messages = converse(stack, sid)  # [sys, u1, a1, tool, a2, u2, a3]
    session = stack.store.get(sid)
    first_two = [r.total_ids for r in session.records[:2]]

    changed = [dict(m) for m in messages] + [{"role": "user", "content": "more"}]
    changed[1]["content"] = "What is 2+4?"
    status, body = chat(stack, sid, changed)
    assert status == 400 and body["error"]["code"] == "history_changed"
    assert "message 1" in body["error"]["message"]
    edited = [dict(m) for m in messages] + [{"role": "user", "content": "more"}]
    edited[4]["content"] = "an answer the model never gave"
    assert chat(stack, sid, edited)[0] == 400

    # Roll back the last assistant turn: its record is replaced, the earlier ones kept.
    status, reply = chat(stack, sid, messages[:-1], seed=7, temperature=1.0)
    assert status == 200, reply
    assert len(session.records) == 3
    assert [r.total_ids for r in session.records[:2]] == first_two
    # Two assistant turns back → refused, state untouched.
    status, body = chat(stack, sid, messages[:4])
    assert status == 400 and body["error"]["code"] == "history_changed"
    assert len(session.records) == 3
    # Ending on the assistant's message, or appending an assistant message: refused.
    assert chat(stack, sid, session.messages)[0] == 400
    forged = session.messages + [
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "y"},
    ]
    status, body = chat(stack, sid, forged)
    assert status == 400 and "assistant" in body["error"]["message"]
    # n > 1 is not a session.
    assert chat(stack, sid, session.messages + [{"role": "user", "content": "z"}], n=2)[0] == 400


def test_unknown_session_404_and_empty_session_422(stack: Stack) -> None:
    for method, path in (
        ("GET", "/sessions/nope"),
        ("DELETE", "/sessions/nope"),
        ("POST", "/sessions/nope/samples"),
    ):
        status, body = stack.run(call(stack.url, path, method=method))
        assert status == 404 and body["error"]["code"] == "session_not_found"
    status, _ = chat(stack, "nope", [{"role": "user", "content": "hi"}])
    assert status == 404
    sid = new_session(stack)
    status, body = stack.run(call(stack.url, f"/sessions/{sid}/samples", {}))
    assert status == 422 and "no turns" in body["error"]["message"]


def test_delete_releases_the_routing_key(stack: Stack) -> None:
    sid = new_session(stack)
    assert chat(stack, sid, [{"role": "user", "content": "hi"}])[0] == 200
    assert stack.router.key_target(sid) == stack.engine_url
    active = stack.run(call(stack.router_url, "/metrics", method="GET"))[1]["active_keys"]
    status, body = stack.run(call(stack.url, f"/sessions/{sid}", method="DELETE"))
    assert status == 200 and body == {"session_id": sid, "deleted": True, "key_released": True}
    metrics = stack.run(call(stack.router_url, "/metrics", method="GET"))[1]
    assert metrics["active_keys"] == active - 1 and stack.router.key_target(sid) is None
    assert stack.run(call(stack.url, f"/sessions/{sid}", method="GET"))[0] == 404


def test_plain_engine_upstream_and_engine_down(stack: Stack) -> None:
    async def scenario() -> None:
        app = make_session_app(stack.engine_url, stack.chat_tokenizer, model_name="tiny")
        runner, url = await start_app(app)
        try:
            sid = (await call(url, "/sessions"))[1]["session_id"]
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            status, reply = await call(url, f"/sessions/{sid}/v1/chat/completions", body)
            assert status == 200 and reply["usage"]["completion_tokens"] <= 3
            # A plain engine has no /release_key: its 404 is no error.
            status, gone = await call(url, f"/sessions/{sid}", method="DELETE")
            assert status == 200 and gone["key_released"] is False
        finally:
            await runner.cleanup()
        # An engine that is down: 502 with the reason, and the session is unchanged.
        dead_runner, dead_url = await start_app(web.Application())
        await dead_runner.cleanup()
        app = make_session_app(dead_url, stack.chat_tokenizer, model_name="tiny")
        runner, url = await start_app(app)
        try:
            sid = (await call(url, "/sessions"))[1]["session_id"]
            status, reply = await call(url, f"/sessions/{sid}/v1/chat/completions", body)
            assert status == 502 and "unreachable" in reply["error"]["message"]
            assert (await call(url, f"/sessions/{sid}", method="GET"))[1]["num_turns"] == 0
        finally:
            await runner.cleanup()

    stack.run(scenario())


def test_upstream_refusal_is_its_4xx_with_its_message(stack: Stack) -> None:
    sid = new_session(stack)
    status, body = chat(stack, sid, [{"role": "user", "content": "hi"}], top_k=0)
    assert status == 400 and "refused the request (400)" in body["error"]["message"]
    assert "top_k" in body["error"]["message"]
    assert stack.store.get(sid).records == []


def test_stream_is_one_chunk_then_done(stack: Stack) -> None:
    sid = new_session(stack)

    async def scenario() -> list[str]:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        async with aiohttp.ClientSession() as client:
            path = f"{stack.url}/sessions/{sid}/v1/chat/completions"
            async with client.post(path, json=body) as r:
                assert r.content_type == "text/event-stream"
                return [line.decode().strip() async for line in r.content if line.strip()]

    events = stack.run(scenario())
    assert len(events) == 2 and events[1] == "data: [DONE]"
    chunk = json.loads(events[0].removeprefix("data: "))
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"]["role"] == "assistant"
    assert chunk["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(stack.store.get(sid).records) == 1


def test_official_openai_client(stack: Stack) -> None:
    openai = pytest.importorskip("openai")
    sid = new_session(stack)
    client = openai.OpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="unused")
    messages: list[Any] = [{"role": "user", "content": "Count to three."}]
    for turn in range(3):
        completion = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, temperature=0, seed=turn
        )
        answer = completion.choices[0].message
        assert completion.usage is not None and completion.usage.completion_tokens <= 4
        messages += [answer, {"role": "user", "content": f"Go on ({turn})."}]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, stream=True
    )
    chunks = list(stream)
    assert len(chunks) == 1 and chunks[0].choices[0].delta.role == "assistant"
    records = stack.store.get(sid).records
    assert len(records) == 4
    sample = stack.store.assemble(sid)
    assert sample.tokens == records[-1].total_ids and sum(sample.loss_mask) == sum(
        len(r.output_ids) for r in records
    )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "changed"}] + messages[1:]
        )
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(
            base_url=f"{stack.url}/sessions/missing/v1", api_key="unused"
        ).chat.completions.create(model="tiny", messages=messages)


def test_tool_calls_parsed_and_compared_by_name_and_arguments() -> None:
    from verst.sessions.store import parse_tool_calls, same_message

    text = 'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )
    stored = {"role": "assistant", "content": content, "tool_calls": calls}
    echoed = {  # what a client sends back: a new id, arguments re-serialised
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"a":2}'}}
        ],
    }
    assert same_message(stored, echoed)
    echoed["tool_calls"][0]["function"]["arguments"] = '{"a": 3}'
    assert not same_message(stored, echoed)
    assert same_message({"role": "user", "content": None}, {"role": "user", "content": ""})
