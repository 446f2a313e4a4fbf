"""The agent-function layer over real loopback servers (a tiny engine behind the router, with
sessions on, behind the session server with a tool-calling template): a two-turn tool agent
through the official `openai` client assembles into exact samples (loss mask 0 on tool tokens,
per-turn versions, metadata merged, session deleted and its key released); agents that raise,
time out, return junk or never call the model abort only their sample; truncation on a turn
boundary; rewards skip aborted samples; config-time checks of the import path."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from tests.servers import (  # noqa: E402
    LoopThread,
    call,
    new_serving,
    serve_engine,
    start_app,
    tiny_config,
    tiny_model,
)
from verst.models.tiny import build_char_tokenizer  # noqa: E402
from verst.rollout.agent import (  # noqa: E402
    AgentConfig,
    agent_metrics,
    agent_request_kwargs,
    load_agent_fn,
    run_agent_groups,
)
from verst.rollout.rewards import RewardScorer  # noqa: E402
from verst.router import Router  # noqa: E402
from verst.router.server import make_router_app  # noqa: E402
from verst.sessions import CHATML_TOOL_TEMPLATE, ChatTokenizer  # noqa: E402
from verst.sessions.server import make_session_app  # noqa: E402
from verst.sessions.store import SessionStore  # noqa: E402
from verst.types import Sample, Status  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
TOOL_OUTPUT = "calculator says: 42"
KWARGS = agent_request_kwargs(model="tiny", max_tokens=4, temperature=1.0, top_k=50)


# ---- agents (module level, so that config tests can name them by import path) -------------


async def tool_agent(
    base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    """Ask, "run the calculator" whatever the model said, and ask again."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none") as client:
        messages: list[Any] = [{"role": "user", "content": prompt}]
        first = await client.chat.completions.create(
            messages=messages, tools=TOOLS, **request_kwargs
        )
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": TOOL_OUTPUT})
        second = await client.chat.completions.create(
            messages=messages, tools=TOOLS, **request_kwargs
        )
    return {"answer": second.choices[0].message.content, "label_seen": metadata["label"]}


async def raising_agent(base_url: str, prompt: Any, request_kwargs: Any, metadata: Any) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none") as client:
        await client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **request_kwargs
        )
    raise ValueError("the environment broke")


async def slow_agent(base_url: str, prompt: Any, request_kwargs: Any, metadata: Any) -> None:
    await asyncio.sleep(30)


async def junk_agent(base_url: str, prompt: Any, request_kwargs: Any, metadata: Any) -> Any:
    return "not a dict"


async def idle_agent(base_url: str, prompt: Any, request_kwargs: Any, metadata: Any) -> None:
    return None


def sync_agent(base_url: str, prompt: Any, request_kwargs: Any, metadata: Any) -> None:
    return None


async def two_arg_agent(base_url: str, prompt: Any) -> None:
    return None


# ---- the stack -----------------------------------------------------------------------------


@dataclass
class Stack:
    loop: LoopThread
    router: Router
    store: SessionStore
    url: str
    chat_tokenizer: ChatTokenizer


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir = tiny_model(
        tmp_path_factory.mktemp("models"), config=tiny_config(max_position_embeddings=1024)
    )
    loop = LoopThread()

    async def setup() -> tuple[Any, ...]:
        engine = await serve_engine(new_serving(model_dir))
        router = Router([engine.url], sessions=True)
        routed = await start_app(make_router_app(router, health_interval_s=0.5))
        tokenizer = build_char_tokenizer()
        tokenizer.chat_template = CHATML_TOOL_TEMPLATE
        chat_tokenizer = ChatTokenizer(tokenizer)
        store = SessionStore(chat_tokenizer)
        app = make_session_app(routed[1], chat_tokenizer, model_name="tiny", store=store)
        sessions = await start_app(app)
        return engine, router, routed, store, sessions, chat_tokenizer

    engine, router, routed, store, sessions, ct = loop.run(setup())
    yield Stack(loop, router, store, sessions[1], ct)
    for runner in (sessions[0], routed[0], engine.runner):
        loop.run(runner.cleanup())
    loop.close()


def groups_of(stack: Stack, n_groups: int, size: int) -> list[list[Sample]]:
    groups = []
    for g in range(n_groups):
        prompt = f"What is 6*{g + 7}?"
        ids = stack.chat_tokenizer.encode(prompt)
        groups.append(
            [
                Sample(
                    prompt=prompt,
                    label=str(6 * (g + 7)),
                    tokens=list(ids),
                    metadata={"source": "test"},
                    group_index=g,
                    index=i,
                )
                for i in range(size)
            ]
        )
    return groups


def run(stack: Stack, groups: list[list[Sample]], agent: Any, **kwargs: Any) -> list[list[Sample]]:
    """The agents on their own loop (as `verst train` runs them), the servers on theirs."""
    options = {"timeout_s": 20.0, "max_concurrency": 4} | kwargs
    return asyncio.run(run_agent_groups(stack.url, groups, agent, KWARGS, **options))


# ---- tests ---------------------------------------------------------------------------------


def test_two_turn_tool_agent_assembles_exact_samples(stack: Stack) -> None:
    groups = run(stack, groups_of(stack, 2, 3), tool_agent)
    ct = stack.chat_tokenizer
    for group in groups:
        for sample in group:
            assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.metadata
            meta = sample.metadata
            assert meta["num_turns"] == 2 and meta["dropped_turns"] == 0
            assert meta["source"] == "test" and meta["label_seen"] == sample.label  # merged
            assert meta["answer"] == meta["response_text"]
            assert [m["role"] for m in meta["messages"]] == [
                "user",
                "assistant",
                "tool",
                "assistant",
            ]
            assert len(sample.weight_versions) == 2
            sample.validate()
            # The prompt is the first turn's rendering, tools included.
            assert "calculator" in ct.tokenizer.decode(sample.prompt_tokens)
            # Loss mask 1 exactly on what the model sampled, 0 on the tool turn between.
            sampled = [
                lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if m
            ]
            assert 2 <= len(sampled) <= 8 and all(lp <= 0.0 for lp in sampled)
            written = [
                t for t, m in zip(sample.response_tokens, sample.loss_mask, strict=True) if not m
            ]
            assert TOOL_OUTPUT in ct.tokenizer.decode(written)
            assert all(
                lp == 0.0
                for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True)
                if not m
            )
            # The session is gone and its routing key released.
            status, _ = stack.loop.run(
                call(stack.url, f"/sessions/{meta['session_id']}", method="GET")
            )
            assert status == 404
            assert stack.router.key_target(meta["session_id"]) is None
    assert stack.store.sessions == {}
    assert stack.router.metrics()["active_keys"] == 0
    metrics = agent_metrics(groups)
    assert metrics["rollout/agent_aborted_ratio"] == 0.0
    assert metrics["rollout/agent_turns_mean"] == 2.0
    # Every trajectory's tokens are a canonical re-render of its messages (append-only template).
    assert metrics["tito/mismatch_measured"] == sum(len(g) for g in groups)
    for kind in ("special_token_count", "special_token_type", "non_assistant_text"):
        assert metrics[f"tito/mismatch_{kind}"] == 0.0


def test_raise_and_timeout_abort_only_their_sample(stack: Stack) -> None:
    async def mixed(base_url: str, prompt: Any, request_kwargs: Any, metadata: Any) -> Any:
        kind = metadata["kind"]
        agent = {"ok": tool_agent, "raise": raising_agent, "slow": slow_agent}[kind]
        return await agent(base_url, prompt, request_kwargs, metadata)

    [group] = groups_of(stack, 1, 3)
    for sample, kind in zip(group, ("ok", "raise", "slow"), strict=True):
        sample.metadata["kind"] = kind
    prompt_tokens = list(group[1].prompt_tokens)
    [group] = run(stack, [group], mixed, timeout_s=3.0)
    ok, raised, slow = group
    assert ok.status in (Status.COMPLETED, Status.TRUNCATED) and "agent_error" not in ok.metadata
    assert raised.status is Status.ABORTED
    assert "ValueError: the environment broke" in raised.metadata["agent_error"]
    assert raised.tokens == prompt_tokens and raised.response_length == 0
    assert raised.loss_mask == [] and raised.rollout_logprobs == []
    assert slow.status is Status.ABORTED and "timeout" in slow.metadata["agent_error"]
    assert slow.metadata["agent_time_s"] < 10
    assert stack.store.sessions == {} and stack.router.metrics()["active_keys"] == 0

    async def reward(sample: Sample) -> float:
        return 1.0 if sample.metadata.get("answer") is not None else 0.5

    RewardScorer(reward).score_groups([group])
    assert ok.reward == 1.0 and raised.reward == 0.0 and slow.reward == 0.0
    assert raised.status is Status.ABORTED  # scoring does not overwrite the abort
    assert agent_metrics([group])["rollout/agent_aborted_ratio"] == pytest.approx(2 / 3)


def test_tito_mismatch_metrics_are_means_over_measured_trajectories() -> None:
    def sample(mismatch: Any, status: Status = Status.COMPLETED) -> Sample:
        return Sample(prompt="p", tokens=[1], status=status, metadata={"mismatch": mismatch})

    zero = dict.fromkeys(("special_token_count", "special_token_type", "non_assistant_text"), 0)
    group = [
        sample({**zero, "assistant_text": 3}),
        sample({**zero, "non_assistant_text": 1, "assistant_text": 1}),
        sample(None),  # not measured (the first turn was cut)
        sample({**zero, "special_token_count": 9, "assistant_text": 0}, Status.ABORTED),
    ]
    metrics = agent_metrics([group])
    assert metrics["tito/mismatch_measured"] == 2
    assert metrics["tito/mismatch_assistant_text"] == 2.0
    assert metrics["tito/mismatch_non_assistant_text"] == 0.5
    assert metrics["tito/mismatch_special_token_count"] == 0.0
    assert "tito/mismatch_measured" not in agent_metrics([[sample(None)]])


def test_junk_result_and_no_model_call_abort(stack: Stack) -> None:
    [[junk]] = run(stack, groups_of(stack, 1, 1), junk_agent)
    assert junk.status is Status.ABORTED and "not a dict" in junk.metadata["agent_error"]
    [[idle]] = run(stack, groups_of(stack, 1, 1), idle_agent)
    assert idle.status is Status.ABORTED and "no turns" in idle.metadata["agent_error"]
    assert stack.store.sessions == {}


def test_unreachable_session_server_aborts(stack: Stack) -> None:
    groups = groups_of(stack, 1, 2)
    asyncio.run(
        run_agent_groups(
            "http://127.0.0.1:9", groups, tool_agent, KWARGS, timeout_s=5.0, max_concurrency=2
        )
    )
    for sample in groups[0]:
        assert sample.status is Status.ABORTED
        assert "could not open a session" in sample.metadata["agent_error"]


def test_truncation_on_a_turn_boundary(stack: Stack) -> None:
    [[full]] = run(stack, groups_of(stack, 1, 1), tool_agent)
    assert full.metadata["num_turns"] == 2
    # Room for the prompt and the first turn's answer only (at most 4 tokens), not the second.
    limit = full.prompt_length + 4
    [[cut]] = run(stack, groups_of(stack, 1, 1), tool_agent, max_seq_len=limit)
    assert cut.status is Status.TRUNCATED
    assert cut.metadata["num_turns"] == 1 and cut.metadata["dropped_turns"] == 1
    assert len(cut.weight_versions) == 1 and all(cut.loss_mask)
    assert len(cut.tokens) <= limit
    # The agent's own result still merges; response_text is the last kept answer.
    assert cut.metadata["response_text"] == cut.metadata["messages"][1]["content"]


def test_max_concurrency_bounds_open_sessions(stack: Stack) -> None:
    peak = 0
    open_now = 0

    async def counting(base_url: str, prompt: Any, request_kwargs: Any, metadata: Any) -> Any:
        nonlocal peak, open_now
        open_now += 1
        peak = max(peak, open_now)
        try:
            return await tool_agent(base_url, prompt, request_kwargs, metadata)
        finally:
            open_now -= 1

    groups = run(stack, groups_of(stack, 2, 4), counting, max_concurrency=3)
    assert peak == 3
    assert all(s.status is not Status.ABORTED for g in groups for s in g)


def test_config_checks_the_import_path() -> None:
    assert AgentConfig().agent_function is None
    cfg = AgentConfig(agent_function="tests.test_agent:tool_agent", agent_timeout_s=5)
    assert load_agent_fn(cfg.agent_function) is tool_agent
    with pytest.raises(ValidationError, match="not found"):
        AgentConfig(agent_function="tests.no_such_module:run_agent")
    with pytest.raises(ValidationError, match="has no attribute"):
        AgentConfig(agent_function="tests.test_agent:nope")
    with pytest.raises(ValidationError, match="async def"):
        AgentConfig(agent_function="tests.test_agent:sync_agent")
    with pytest.raises(ValidationError, match="must take"):
        AgentConfig(agent_function="tests.test_agent:two_arg_agent")
    with pytest.raises(ValidationError):
        AgentConfig(agent_timeout_s=0)


def test_request_kwargs_fit_the_openai_client() -> None:
    assert agent_request_kwargs(model="m", max_tokens=8, temperature=0.5) == {
        "model": "m",
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 1.0,
    }
    kwargs = agent_request_kwargs(
        model="m", max_tokens=8, temperature=1.0, top_k=5, stop_token_ids=[7]
    )
    assert kwargs["extra_body"] == {"top_k": 5, "stop_token_ids": [7]}


def test_run_config_validates_rollout_agent_function() -> None:
    from verst.config import ConfigError, load_config

    serving = ["placement.engines=in_process"]
    cfg = load_config(None, serving + ["rollout.agent_function=tests.test_agent:tool_agent"])
    assert cfg.rollout.agent_function == "tests.test_agent:tool_agent"
    with pytest.raises(ConfigError, match="rollout.agent_function"):
        load_config(None, serving + ["rollout.agent_function=tests.test_agent:sync_agent"])
    with pytest.raises(ConfigError, match="needs serving engines"):
        load_config(None, ["rollout.agent_function=tests.test_agent:tool_agent"])
