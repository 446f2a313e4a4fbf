"""The environment layer: actions parsed from the session server's tool calls and checked
against the declared tools, the built-in python tool environment in a real sandbox, the error
policy (observe / abort) for bad calls and failing environments, and whole episodes played
through the agent-function layer against real loopback servers (a tiny engine behind the
router and the session server), sandboxes cleaned up after every episode."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from tests.servers import (  # noqa: E402
    LoopThread,
    new_serving,
    serve_engine,
    start_app,
    tiny_config,
    tiny_model,
)
from verst.config import ConfigError, load_config  # noqa: E402
from verst.envs.base import (  # noqa: E402
    Action,
    Environment,
    StepResult,
    Tool,
    ToolCall,
    ToolCallError,
    check_calls,
    parse_action,
)
from verst.envs.python_tool import PythonToolEnv  # noqa: E402
from verst.envs.runner import EnvConfig, EnvironmentAgent, env_reward  # noqa: E402
from verst.envs.sandbox import SandboxConfig, bubblewrap_problem, make_sandbox  # noqa: E402
from verst.envs.sandbox.limits import marked_pids  # noqa: E402
from verst.models.tiny import build_char_tokenizer  # noqa: E402
from verst.rollout.agent import agent_request_kwargs, run_agent_groups  # noqa: E402
from verst.router import Router  # noqa: E402
from verst.router.server import make_router_app  # noqa: E402
from verst.sessions import CHATML_TOOL_TEMPLATE, ChatTokenizer  # noqa: E402
from verst.sessions.server import make_session_app  # noqa: E402
from verst.sessions.store import SessionStore  # noqa: E402
from verst.types import Sample, Status  # noqa: E402

KWARGS = agent_request_kwargs(model="tiny", max_tokens=4, temperature=1.0)


def sandbox_cfg(tmp_path: Path, **fields: Any) -> SandboxConfig:
    if (problem := bubblewrap_problem()) is not None:
        pytest.skip(f"bwrap fails its probe here: {problem}")
    limits = dict(timeout_s=2.0, memory_bytes=256 << 20, max_processes=16, pool_size=2)
    return SandboxConfig(**{**limits, **fields})


def left_behind(box_ids: list[str]) -> list[str]:
    """What is left of these sandboxes: work directories, and processes."""
    dirs = [str(p) for i in box_ids for p in Path(tempfile.gettempdir()).glob(f"verst-sbx-{i}-*")]
    return dirs + [f"pid {pid}" for i in box_ids for pid in marked_pids(i)]


def call_message(name: str, arguments: Any) -> dict[str, Any]:
    """An assistant message as the session server answers a parsed tool call."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}
        ],
    }


# ---- actions and tools --------------------------------------------------------------------


def test_actions_from_the_session_servers_answers() -> None:
    action = parse_action(call_message("python", {"code": "print(1)"}), "tool_calls")
    assert action.tool_calls == [ToolCall("call_1", "python", {"code": "print(1)"})]
    assert action.malformed == [] and action.finish_reason == "tool_calls"
    bad_json = parse_action(call_message("python", "{not json"))
    assert bad_json.tool_calls == [] and "not a JSON object" in bad_json.malformed[0]
    # a block the server could not parse stays in the text
    unparsed = parse_action({"content": '<tool_call>{"name": "python", </tool_call>'})
    assert unparsed.tool_calls == [] and "<tool_call>" in unparsed.malformed[0]
    assert parse_action({"content": "42"}) == Action(content="42")
    # a turn cut at the token limit never ended: its calls are not run
    cut = parse_action(call_message("python", {"code": "print(1)"}), "length")
    assert cut.tool_calls == [] and "token limit" in cut.malformed[0]


def test_calls_are_checked_against_the_declared_tools() -> None:
    tools = PythonToolEnv(None).tools
    assert [t.schema() for t in tools] == [
        {
            "type": "function",
            "function": {
                "name": "python",
                "description": "Run Python 3 code; returns what it prints",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string"}},
                    "required": ["code"],
                },
            },
        }
    ]
    cases = {
        "unknown tool 'shell'": Action("", [ToolCall("c", "shell", {"cmd": "ls"})]),
        "missing argument 'code'": Action("", [ToolCall("c", "python", {})]),
        "unknown argument 'x'": Action("", [ToolCall("c", "python", {"code": "", "x": 1})]),
        "must be a string": Action("", [ToolCall("c", "python", {"code": 3})]),
        "not valid JSON": Action("", malformed=["a <tool_call> block that is not valid JSON"]),
    }
    for message, action in cases.items():
        with pytest.raises(ToolCallError, match=message):
            check_calls(action, tools)
    flag = Tool("t", "", {"n": {"type": "integer"}})
    with pytest.raises(ToolCallError, match="integer"):
        flag.check({"n": True})  # JSON true is not an integer
    check_calls(Action("", [ToolCall("c", "python", {"code": "1"})]), tools)


# ---- the python tool environment in a sandbox ------------------------------------------


def test_python_tool_env_runs_code_in_the_sandbox_and_scores(tmp_path: Path) -> None:
    cfg = EnvConfig(name="python_tool", max_observation_chars=100, sandbox=sandbox_cfg(tmp_path))
    agent = EnvironmentAgent(cfg)

    async def play() -> list[StepResult]:
        with make_sandbox(cfg.sandbox) as box:
            env = PythonToolEnv(box)
            opening = await env.reset("37*48", {"label": "1776"})
            assert opening == [{"role": "user", "content": "37*48"}]
            tally = _tally()
            steps = []
            for message in (
                call_message("python", {"code": "print(37*48)"}),
                call_message("python", {"code": "while True: pass"}),
                call_message("python", {"code": "print('x' * 5_000_000)"}),
                call_message("python", {"code": "open('/usr/x', 'w')"}),
                {"content": "the answer is 1776"},
            ):
                steps.append(await agent._step(env, parse_action(message), tally))
            return steps

    result, loop, flood, denied, final = asyncio.run(play())
    assert result.observation[0]["content"] == "1776" and not result.done
    assert result.observation[0]["tool_call_id"] == "call_1"
    assert "timed out (killed)" in loop.observation[0]["content"]
    assert len(agent._cut(flood.observation[0])["content"]) < 200  # cut for the model
    assert "Read-only file system" in denied.observation[0]["content"]
    assert final.done and final.reward == 1.0 and final.info["tool_runs"] == 4


def _tally() -> Any:
    from verst.envs.runner import _Tally

    return _Tally()


class BrokenEnv(Environment):
    async def reset(self, prompt: Any, metadata: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": str(prompt)}]

    async def step(self, action: Action) -> StepResult:
        raise RuntimeError("the checker crashed")


@pytest.mark.parametrize("on_error", ["observe", "abort"])
def test_bad_calls_and_failing_environments_follow_on_error(on_error: str) -> None:
    agent = EnvironmentAgent(EnvConfig(name="tests.test_envs:BrokenEnv", on_error=on_error))
    env = BrokenEnv()
    unknown = parse_action(call_message("rm", {"path": "/"}))
    for action, reason in ((unknown, "unknown tool 'rm'"), (Action("hi"), "the checker crashed")):
        tally = _tally()
        if on_error == "abort":
            with pytest.raises(Exception, match=reason):
                asyncio.run(agent._step(env, action, tally))
            continue
        result = asyncio.run(agent._step(env, action, tally))
        [message] = result.observation
        assert reason in message["content"] and not result.done
        assert message["role"] == ("tool" if action.tool_calls else "user")
        assert tally.summary()["env_errors"] == 1


# ---- episodes through the session server -------------------------------------------------


class CountdownEnv(Environment):
    """Three model turns whatever the model says, a user observation between them."""

    async def reset(self, prompt: Any, metadata: dict[str, Any]) -> list[dict[str, Any]]:
        self.turns = 0
        return [{"role": "user", "content": str(prompt)}]

    async def step(self, action: Action) -> StepResult:
        self.turns += 1
        done = self.turns == 3
        observation = [] if done else [{"role": "user", "content": f"OBSERVATION {self.turns}"}]
        return StepResult(observation, reward=0.5, done=done, info={"last": action.content})


class FailingResetEnv(PythonToolEnv):
    async def reset(self, prompt: Any, metadata: dict[str, Any]) -> list[dict[str, Any]]:
        raise RuntimeError("no task today")


@pytest.fixture(scope="module")
def sessions_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
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
        chat = ChatTokenizer(tokenizer)
        app = make_session_app(routed[1], chat, model_name="tiny", store=SessionStore(chat))
        sessions = await start_app(app)
        return engine, routed, sessions

    engine, routed, sessions = loop.run(setup())
    yield sessions[1]
    for runner in (sessions[0], routed[0], engine.runner):
        loop.run(runner.cleanup())
    loop.close()


def play(url: str, agent: EnvironmentAgent, n: int = 4) -> list[Sample]:
    """`n` samples of one prompt played by `agent`; then its pool is closed, and the ids of
    the sandboxes it opened are in `agent.opened`."""
    tokenizer = build_char_tokenizer()
    samples = [
        Sample(prompt="37*48", label="1776", tokens=tokenizer.encode("37*48"), index=i)
        for i in range(n)
    ]

    async def run() -> None:
        await run_agent_groups(url, [samples], agent, KWARGS, timeout_s=30, max_concurrency=4)
        pool = agent.pool()
        if pool is not None:
            pool.close()
            agent.opened = pool.opened  # type: ignore[attr-defined]

    asyncio.run(run())
    return samples


def test_multi_turn_episode_through_the_session_server(sessions_url: str) -> None:
    agent = EnvironmentAgent(EnvConfig(name="tests.test_envs:CountdownEnv"))
    samples = play(sessions_url, agent, n=2)
    tokenizer = build_char_tokenizer()
    for sample in samples:
        assert sample.status is not Status.ABORTED, sample.metadata
        meta = sample.metadata
        assert meta["num_turns"] == 3 and meta["env_steps"] == 3 and meta["env_done"]
        assert env_reward(sample) == 1.5
        observed = [
            t for t, m in zip(sample.response_tokens, sample.loss_mask, strict=True) if not m
        ]
        assert "OBSERVATION 1" in tokenizer.decode(observed)  # masked out of the loss
        assert "OBSERVATION" not in tokenizer.decode(
            [t for t, m in zip(sample.response_tokens, sample.loss_mask, strict=True) if m]
        )


def test_python_tool_episodes_clean_up_their_sandboxes(sessions_url: str, tmp_path: Path) -> None:
    cfg = EnvConfig(name="python_tool", sandbox=sandbox_cfg(tmp_path))
    agent = EnvironmentAgent(cfg)
    samples = play(sessions_url, agent)
    for sample in samples:  # the random model answers without a tool call: scored 0
        assert sample.status is not Status.ABORTED, sample.metadata
        assert sample.metadata["env_steps"] >= 1 and sample.metadata["env_reward"] == 0.0
    assert len(agent.opened) >= len(samples)  # type: ignore[attr-defined]
    assert left_behind(agent.opened) == []  # type: ignore[attr-defined]


def test_failing_reset_and_a_sandbox_that_cannot_start_abort_only_their_sample(
    sessions_url: str, tmp_path: Path
) -> None:
    broken = EnvironmentAgent(
        EnvConfig(name="tests.test_envs:FailingResetEnv", sandbox=sandbox_cfg(tmp_path))
    )
    for sample in play(sessions_url, broken, n=2):
        assert sample.status is Status.ABORTED
        assert "no task today" in sample.metadata["agent_error"]
    assert broken.opened and left_behind(broken.opened) == []  # type: ignore[attr-defined]
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    nowhere = EnvConfig(
        name="python_tool", sandbox=sandbox_cfg(tmp_path, work_root=str(blocker / "x"))
    )
    for sample in play(sessions_url, EnvironmentAgent(nowhere), n=2):
        assert sample.status is Status.ABORTED
        assert "sandbox could not start" in sample.metadata["agent_error"]


def test_env_config_errors_name_the_field() -> None:
    serving = ["placement.engines=in_process"]
    with pytest.raises(ConfigError, match="env.name: .*no_such_env"):
        load_config(None, [*serving, "env.name=no_such_env"])
    with pytest.raises(ConfigError, match="env.name: .*not a verst.envs.base.Environment"):
        load_config(None, [*serving, "env.name=verst.envs.runner:env_reward"])
    with pytest.raises(ConfigError, match="env.name and rollout.agent_function"):
        load_config(
            None,
            [
                *serving,
                "env.name=python_tool",
                "rollout.agent_function=tests.test_agent:tool_agent",
            ],
        )
    with pytest.raises(ConfigError, match="env.name needs serving engines"):
        load_config(None, ["env.name=python_tool"])
    with pytest.raises(ConfigError, match="env.on_error"):
        load_config(None, [*serving, "env.name=python_tool", "env.on_error=ignore"])
    cfg = load_config(None, [*serving, "env.name=python_tool", "env.sandbox.provider=process"])
    assert cfg.env.sandbox.provider == "process" and cfg.plays_agents == "env.name"
