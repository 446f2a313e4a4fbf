"""Multi-turn verifiers environments (`env.options.env`, a `vf.Env`) against the real `verifiers`
package, offline: `examples/verifiers_guess.py` (guess the number: the env answers "higher" /
"lower" until the right guess) with scripted turns and through the session server, the ways an
exchange ends (the env, verst's turns, the seat's `max_turns`, a task `@vf.stop`), what is
refused, and `examples/verifiers_guess.yaml` for two steps through `verst train`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

vf = pytest.importorskip("verifiers.v1")
pytest.importorskip("aiohttp")

from examples.verifiers_guess import (  # noqa: E402
    GuessConfig,
    GuessEnv,
    GuessTask,
    GuessTaskset,
    hint,  # noqa: E402
)
from tests.test_builtin_envs import scripted  # noqa: E402
from tests.test_env_train import TINY_RUN  # noqa: E402
from tests.test_envs import KWARGS, sessions_url  # noqa: E402, F401
from tests.test_loop import records  # noqa: E402
from verst.cli import main  # noqa: E402
from verst.data.tasks import make_task  # noqa: E402
from verst.envs.runner import EnvConfig, EnvironmentAgent, EpisodeError  # noqa: E402
from verst.envs.verifiers_connector import VerifiersEnvironment, load_tasks  # noqa: E402
from verst.models.tiny import build_char_tokenizer  # noqa: E402
from verst.rollout.agent import run_agent_groups  # noqa: E402
from verst.types import Sample, Status  # noqa: E402

HERE = "tests.test_verifiers_multiturn"
TASKSET = {"taskset": "examples.verifiers_guess:load_taskset", "args": {"num_tasks": 8}}
ENV = "examples.verifiers_guess:GuessEnv"


class QuitTask(GuessTask):
    @vf.stop
    async def gave_up(self, trace: vf.Trace) -> bool:
        return trace.last_reply == "quit"


class QuitTaskset(GuessTaskset):
    def load(self) -> Any:
        for task in super().load():
            yield QuitTask(task.data, task.config)


def quit_taskset() -> QuitTaskset:
    return QuitTaskset(GuessConfig(num_tasks=2))


class PairConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    judge: vf.AgentConfig = vf.AgentConfig()


class PairEnv(vf.Env[PairConfig]):
    async def run(self, task: Any, agents: Any) -> None:
        raise AssertionError("never played")


class WholeRunEnv(GuessEnv):
    async def run(self, task: Any, agents: Any) -> None:
        await agents.player.run(task)


class SpectatorEnv(GuessEnv):
    async def setup(self, agents: Any) -> None:
        agents.player.trainable = False


class CrashingEnv(GuessEnv):
    async def run(self, task: Any, agents: Any) -> None:
        async with agents.player.interaction(task) as game:
            await game.turn()
            raise RuntimeError("the game engine crashed")


def env_cfg(env: str = ENV, taskset: dict[str, Any] = TASKSET, **fields: Any) -> EnvConfig:
    options = {**taskset, "env": env, **fields.pop("options", {})}
    return EnvConfig(name="verifiers", options=options, **fields)


def rows(taskset: dict[str, Any] = TASKSET) -> list[dict[str, Any]]:
    return make_task("verifiers", "train", 0, **taskset)


def play_row(cfg: EnvConfig, row: dict[str, Any], turns: list[str]) -> Any:
    meta = {k: v for k, v in row.items() if k != "prompt"}
    messages = [{"role": "assistant", "content": t} for t in turns]
    return scripted(VerifiersEnvironment, cfg, row["prompt"], meta, messages)


def secret_of(row: dict[str, Any]) -> int:
    tasks = load_tasks(TASKSET["taskset"], TASKSET["args"], where="test")
    return tasks[row["vf_task_idx"]].data.secret


def wrong_guesses(secret: int) -> list[str]:
    """Two wrong guesses (one low or high each where the number allows), then "x"."""
    return [str(1 if secret != 1 else 2), str(8 if secret != 8 else 7), "x"]


def test_the_envs_answers_are_the_next_turns_and_the_right_guess_ends_it() -> None:
    row = rows()[0]
    secret = secret_of(row)
    guesses = [*wrong_guesses(secret), f" {secret}\n"]
    opening, results, last = play_row(env_cfg(max_turns=6), row, guesses)
    assert opening == [{"role": "user", "content": "1-8?"}] == row["prompt"]
    expected = [hint(g.strip(), secret) for g in guesses[:-1]]
    assert [r.observation for r in results[:-1]] == [
        [{"role": "user", "content": h}] for h in expected
    ]
    assert not any(r.done or r.reward for r in results[:-1])
    final = results[-1]
    assert final.done and final.reward == 1.0 and last is None
    assert final.info["vf_rewards"] == {"found": 1.0}
    assert final.info["vf_metrics"] == {"guesses": 4.0}
    assert final.info["vf_stop"] == "user_closed" and final.info["answer"] == str(secret)


def test_verst_turns_running_out_end_the_exchange_as_max_turns() -> None:
    row = rows()[0]
    turns = wrong_guesses(secret_of(row))[:2]
    _, results, last = play_row(env_cfg(max_turns=2), row, turns)
    assert [r.done for r in results] == [False, False]
    assert last is not None and last.done and last.reward == 0.0
    assert last.info["vf_stop"] == "max_turns" and last.info["vf_metrics"] == {"guesses": 2.0}


def test_the_seats_max_turns_and_a_task_stop_end_the_exchange() -> None:
    row = rows()[0]
    turns = wrong_guesses(secret_of(row))
    capped = env_cfg(max_turns=6, options={"env_args": {"player": {"max_turns": 2}}})
    _, results, _ = play_row(capped, row, turns)
    assert [r.done for r in results] == [False, True]
    assert results[-1].info["vf_stop"] == "max_turns" and results[-1].reward == 0.0
    quitting = {"taskset": f"{HERE}:quit_taskset", "args": {}}
    _, results, _ = play_row(env_cfg(taskset=quitting, max_turns=6), rows(quitting)[0], ["quit"])
    [result] = results
    assert result.done and result.info["vf_stop"] == "gave_up"
    assert result.info["vf_metrics"] == {"guesses": 1.0}


def test_a_taskset_id_plays_the_env_its_package_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "vf_guess_pkg.py").write_text(
        "from examples.verifiers_guess import GuessEnv, GuessTaskset\n"
        "__all__ = ['GuessEnv', 'GuessTaskset']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    by_id = {"taskset": "vf_guess_pkg", "args": {"num_tasks": 8}}
    cfg = EnvConfig(name="verifiers", options=by_id, max_turns=3)
    _, results, last = play_row(cfg, rows(by_id)[0], ["x", "x", "x"])
    assert [r.observation for r in results] == [[{"role": "user", "content": "a number"}]] * 3
    assert last is not None and last.info["vf_stop"] == "max_turns"


@pytest.mark.parametrize(
    ("env", "error"),
    [
        (f"{HERE}:PairEnv", "verst plays exactly one"),
        (f"{HERE}:WholeRunEnv", "agent.run"),
        (f"{HERE}:SpectatorEnv", "untrainable"),
        (f"{HERE}:no_such_env", "env.options.env"),
        ("examples.verifiers_guess:hint", "not a vf.Env subclass"),
    ],
)
def test_envs_verst_cannot_play_are_refused_at_reset(env: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        play_row(env_cfg(env=env), rows()[0], ["1"])


def test_a_seat_pinned_to_another_model_is_refused() -> None:
    cfg = env_cfg(options={"env_args": {"player": {"model": "gpt-x"}}})
    with pytest.raises(ValueError, match="sets model"):
        play_row(cfg, rows()[0], ["1"])


def test_an_env_that_raises_aborts_the_episode_whatever_on_error() -> None:
    cfg = env_cfg(env=f"{HERE}:CrashingEnv", on_error="observe")
    with pytest.raises(EpisodeError, match="the game engine crashed"):
        play_row(cfg, rows()[0], ["1"])


def test_episodes_through_the_session_server(sessions_url: str) -> None:  # noqa: F811
    """A random tiny model guesses through the session server: every turn is a model call of
    the session, the env's answers are the user turns between them, the reward the task's."""
    agent = EnvironmentAgent(env_cfg(max_turns=3))
    tokenizer = build_char_tokenizer()
    samples = []
    for i, row in enumerate(rows()[:4]):
        meta = {k: v for k, v in row.items() if k != "prompt"}
        tokens = tokenizer.encode(row["prompt"][-1]["content"])
        samples.append(Sample(prompt=row["prompt"], tokens=tokens, index=i, metadata=meta))
    asyncio.run(
        run_agent_groups(sessions_url, [samples], agent, KWARGS, timeout_s=30, max_concurrency=4)
    )
    for sample in samples:
        assert sample.status is not Status.ABORTED, sample.metadata
        meta = sample.metadata
        messages = meta["messages"]
        replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        assert meta["num_turns"] == meta["env_steps"] == len(replies) and meta["env_done"]
        secret = secret_of(meta)
        assert users[1:] == [hint(r, secret) for r in replies[:-1]]
        found = hint(replies[-1], secret) is None
        assert meta["env_reward"] == float(found) and meta["vf_rewards"] == {"found": found}
        assert len(replies) == 3 or found


def test_verifiers_guess_example_trains_through_the_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["train", "examples/verifiers_guess.yaml", *TINY_RUN, "--run-dir", str(run_dir)]
    assert main(args) == 0
    records_ = records(run_dir)
    assert [r["step"] for r in records_] == [0, 1, 2]
    for row in records_[1:]:
        assert row["rollout/agent_aborted_ratio"] == 0.0 and row["rollout/num_samples"] == 8
        assert row["rollout/env_done_ratio"] == 1.0 and row["rollout/env_steps_mean"] > 1.0
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-4
