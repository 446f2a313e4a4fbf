"""The built-in environments with scripted actions (no model): `math` (math-verify),
`python_code` (unit tests in the sandbox), `terminal` (a shell and a checker in the sandbox)
and `reasoning_gym` (its datasets as rows, its scorers as rewards); reset / step / reward and
the runner's end-of-turns hook, each in a real bubblewrap sandbox where it needs one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.test_envs import _tally, call_message, left_behind, sandbox_cfg
from verst.data.tasks import make_task
from verst.envs.base import Action, Environment, StepResult, tool
from verst.envs.python_code import PythonCodeEnv, extract_code
from verst.envs.runner import EnvConfig, EnvironmentAgent, load_environment
from verst.envs.sandbox import make_sandbox
from verst.envs.terminal import TerminalEnv
from verst.rollout.rewards import load_reward_fn
from verst.types import Sample


def scripted(
    env_cls: type[Environment],
    cfg: EnvConfig,
    prompt: str,
    metadata: dict[str, Any],
    turns: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[StepResult], StepResult | None]:
    """Play `turns` (assistant messages) through the runner's step handling; the opening, the
    step results, and `truncate()`'s result when the turns ran out before done."""
    agent = EnvironmentAgent(cfg)

    async def play() -> tuple[Any, ...]:
        box = make_sandbox(cfg.sandbox).open() if env_cls.needs_sandbox else None
        try:
            env = env_cls(box, cfg.options)
            opening = await env.reset(prompt, metadata)
            steps, tally = [], _tally()
            for message in turns:
                steps.append(await agent._step(env, _parse(message), tally))
                if steps[-1].done:
                    return opening, steps, None
            return opening, steps, await env.truncate()
        finally:
            if box is not None:
                ids.append(box.id)
                box.close()

    ids: list[str] = []
    out = asyncio.run(play())
    assert left_behind(ids) == []
    return out


def _parse(message: dict[str, Any]) -> Action:
    from verst.envs.base import parse_action

    return parse_action(message)


def test_builtins_load_by_bare_name() -> None:
    for name in ("math", "python_code", "terminal", "reasoning_gym", "python_tool"):
        assert issubclass(load_environment(name), Environment)


# ---- math ----------------------------------------------------------------------------------


def test_math_env_checks_answers_with_math_verify() -> None:
    pytest.importorskip("math_verify")
    from verst.envs.math_env import MathEnv, math_equal

    assert math_equal("so the answer is $\\frac{1}{2}$", "0.5")
    assert math_equal("\\boxed{\\sqrt{4}}", "2")
    assert math_equal("x = 3/4", "\\frac{3}{4}")
    assert not math_equal("\\boxed{3}", "2") and not math_equal("no idea", "2")
    cfg = EnvConfig(name="math")
    opening, [right], _ = scripted(
        MathEnv, cfg, "1/2 + 1/4?", {"label": "3/4"}, [{"content": "It is $\\frac{3}{4}$"}]
    )
    assert opening == [{"role": "user", "content": "1/2 + 1/4?"}]
    assert right.done and right.reward == 1.0 and right.info["correct"]
    _, [wrong], _ = scripted(MathEnv, cfg, "1/2 + 1/4?", {"label": "3/4"}, [{"content": "0.7"}])
    assert wrong.done and wrong.reward == 0.0
    reward = load_reward_fn("math_verify")
    sample = Sample(prompt="q", label="\\frac{1}{3}", metadata={"response_text": "\\boxed{1/3}"})
    assert reward(sample) == 1.0


# ---- python_code -----------------------------------------------------------------------------

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def test_extract_code_takes_the_last_fenced_block() -> None:
    text = "first\n```python\nx = 1\n```\nthen\n```\ndef f():\n    return 2\n```\n"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("def f(): return 1") == "def f(): return 1"


def test_python_code_env_scores_the_fraction_of_tests_passed(tmp_path: Path) -> None:
    cfg = EnvConfig(name="python_code", sandbox=sandbox_cfg(tmp_path))
    half = "```python\ndef add(a, b):\n    return a + b if a > 0 else 7\n```"
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    meta = {"tests": TESTS}
    _, [first, second], _ = scripted(
        PythonCodeEnv, cfg, "write add", meta, [{"content": half}, {"content": right}]
    )
    assert not first.done and first.info["tests_passed"] == 2
    assert abs(first.reward - 2 / 3) < 1e-9
    assert "assert add(-1, 1) == 0" in first.observation[0]["content"]
    assert second.done and first.reward + second.reward == 1.0  # the last attempt's fraction
    cheats = [
        "import os\nos._exit(0)",  # exits before the tests
        'print(\'{"passed": [0, 1, 2], "failures": []}\')\nraise SystemExit',
        "while True: pass",  # the sandbox's timeout
        "def add(a, b) return",  # a syntax error
    ]
    for cheat in cheats:
        _, [step], _ = scripted(
            PythonCodeEnv,
            cfg.model_copy(update={"max_turns": 1}),
            "write add",
            meta,
            [{"content": cheat}],
        )
        assert step.reward == 0.0 and step.info["tests_passed"] == 0, cheat


def test_python_code_env_needs_tests(tmp_path: Path) -> None:
    cfg = EnvConfig(name="python_code", sandbox=sandbox_cfg(tmp_path))
    with pytest.raises(ValueError, match="'tests'"):
        scripted(PythonCodeEnv, cfg, "write add", {"tests": []}, [])


# ---- terminal --------------------------------------------------------------------------------


def test_terminal_tasks_are_procedural_disjoint_and_solved_by_their_label(tmp_path: Path) -> None:
    train = make_task("terminal", "train", 0, size=600)
    test = make_task("terminal", "test", 0, size=600)
    assert len(train) == 200 and len(test) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert make_task("terminal", "test", 0, size=600) == test  # the same seed, the same tasks
    assert {r["prompt"].split()[0] for r in test} == {"put", "copy", "count"}
    cfg = EnvConfig(name="terminal", max_turns=1, sandbox=sandbox_cfg(tmp_path))
    for row in test[:6]:  # each row's label solves it; doing nothing does not
        call = call_message("sh", {"cmd": row["label"]})
        _, [step], end = scripted(TerminalEnv, cfg, row["prompt"], row, [call])
        assert not step.done and end is not None and end.reward == 1.0, row
        _, [idle], _ = scripted(TerminalEnv, cfg, row["prompt"], row, [{"content": "done"}])
        assert idle.done and idle.reward == 0.0, row
    with pytest.raises(ValueError, match="unknown task kinds"):
        make_task("terminal", "test", 0, kinds=["rm"])


def test_terminal_env_runs_a_shell_and_checks_at_the_end(tmp_path: Path) -> None:
    cfg = EnvConfig(name="terminal", max_turns=3, sandbox=sandbox_cfg(tmp_path))
    row = {"files": {"in.txt": "a\nb\nc\n"}, "check": '[ "$(cat out)" = 3 ]'}
    turns = [
        call_message("sh", {"cmd": "wc -l < in.txt"}),
        call_message("sh", {"cmd": "wc -l < in.txt > out"}),
        {"content": "finished"},
    ]
    opening, [look, act, done], _ = scripted(TerminalEnv, cfg, "count", row, turns)
    assert opening == [{"role": "user", "content": "count"}]
    assert look.observation[0]["content"].strip() == "3" and look.reward == 0.0
    assert act.observation[0]["content"] == "(no output)"
    assert done.done and done.reward == 1.0 and done.info == {"solved": True, "commands": 2}
    with pytest.raises(ValueError, match="'check'"):
        scripted(TerminalEnv, cfg, "count", {"files": {}}, [])


def test_the_runner_calls_truncate_when_the_turns_run_out() -> None:
    class Budget(Environment):
        async def reset(self, prompt: Any, metadata: dict[str, Any]) -> list[dict[str, Any]]:
            return [{"role": "user", "content": "go"}]

        async def step(self, action: Action) -> StepResult:
            return StepResult([{"role": "user", "content": "more"}], reward=0.25)

        async def truncate(self) -> StepResult:
            return StepResult(reward=1.0, done=True, info={"checked": True})

    tally = _tally()
    tally.add(StepResult(reward=0.25))
    tally.add(asyncio.run(Budget().truncate()), turn=False)
    summary = tally.summary()
    assert summary["env_reward"] == 1.25 and summary["env_steps"] == 1 and summary["checked"]


# ---- reasoning-gym -----------------------------------------------------------------------


def test_reasoning_gym_rows_and_scorer() -> None:
    pytest.importorskip("reasoning_gym")
    from verst.envs.reasoning_gym import ReasoningGymEnv

    kwargs = {"dataset": "basic_arithmetic", "size": 20}
    rows = make_task("reasoning_gym", "train", 0, **kwargs)
    assert len(rows) == 20 and rows == make_task("reasoning_gym", "train", 0, **kwargs)
    assert rows != make_task("reasoning_gym", "test", 0, **kwargs)
    json.dumps(rows)  # rows travel as JSON
    row = rows[0]
    reward = load_reward_fn("reasoning_gym")
    right = Sample(
        prompt=row["prompt"],
        label=row["label"],
        metadata={**row, "response_text": str(row["label"])},
    )
    wrong = Sample(
        prompt=row["prompt"], label=row["label"], metadata={**row, "response_text": "banana"}
    )
    assert reward(right) == 1.0 and reward(wrong) < 1.0
    cfg = EnvConfig(name="reasoning_gym")
    _, [step], _ = scripted(
        ReasoningGymEnv, cfg, row["prompt"], row, [{"content": str(row["label"])}]
    )
    assert step.done and step.reward == 1.0
    with pytest.raises(ValueError, match="rg_entry"):
        scripted(ReasoningGymEnv, cfg, "q", {"label": "1"}, [])
    with pytest.raises(ValueError, match="dataset"):
        make_task("reasoning_gym", "train", 0, dataset="no_such_dataset", size=2)


# ---- bad input in a sandboxed episode ------------------------------------------------------


def test_terminal_commands_that_hang_or_flood_come_back_as_observations(tmp_path: Path) -> None:
    cfg = EnvConfig(name="terminal", max_observation_chars=200, sandbox=sandbox_cfg(tmp_path))
    row = {"files": {}, "check": "true"}
    turns = [
        call_message("sh", {"cmd": "sleep 30"}),
        call_message("sh", {"cmd": "yes | head -c 3000000"}),
        call_message("sh", '{"cmd": "echo'),  # arguments that are not JSON
        call_message("rm", {"cmd": "-rf /"}),  # a tool that does not exist
        {"content": "done"},
    ]
    _, [hang, flood, malformed, unknown, end], _ = scripted(TerminalEnv, cfg, "x", row, turns)
    assert "timed out (killed)" in hang.observation[0]["content"]
    cut = EnvironmentAgent(cfg)._cut(flood.observation[0])["content"]
    assert len(cut) < 300 and cut.endswith("[output cut]")
    assert "not a JSON object" in malformed.observation[0]["content"]
    assert "unknown tool 'rm'" in unknown.observation[0]["content"]
    assert end.done and end.reward == 1.0  # the episode went on to its end


class CrashingTerminal(TerminalEnv):
    @tool("Run a shell command", {"cmd": {"type": "string"}})
    async def sh(self, cmd: str) -> str:
        raise RuntimeError("the tool crashed")


def test_an_environment_that_raises_aborts_and_its_sandbox_is_closed(tmp_path: Path) -> None:
    cfg = EnvConfig(name="terminal", on_error="abort", sandbox=sandbox_cfg(tmp_path))
    agent = EnvironmentAgent(cfg)
    ids: list[str] = []

    async def play() -> None:
        pool = agent.pool()
        assert pool is not None
        async with pool.episode() as box:
            ids.append(box.id)
            env = CrashingTerminal(box)
            await env.reset("x", {"files": {}, "check": "true"})
            await agent._step(env, _parse(call_message("sh", {"cmd": "true"})), _tally())
        pool.close()

    with pytest.raises(Exception, match="the tool crashed"):
        asyncio.run(play())
    assert ids and left_behind(ids) == []
