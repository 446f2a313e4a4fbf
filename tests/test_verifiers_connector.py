"""The verifiers connector (`env.name: verifiers`) against the real `verifiers` package, offline.

A taskset written on verifiers' own classes (`vf.Taskset`, `vf.Task`, `@vf.reward`,
`@vf.metric`) over local data: rows from `data.task: verifiers`, episodes with scripted turns
and through the session server, each scored by the task's own rewards; a reward that raises,
tasks that need a runtime, rows of another taskset; and `examples/verifiers_env.yaml` for two
steps through `verst train`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

vf = pytest.importorskip("verifiers.v1")
pytest.importorskip("aiohttp")

from tests.test_agent_train import QUICK  # noqa: E402
from tests.test_builtin_envs import scripted  # noqa: E402
from tests.test_envs import KWARGS, sessions_url  # noqa: E402, F401
from tests.test_loop import records  # noqa: E402
from verst.cli import main  # noqa: E402
from verst.data.tasks import make_task  # noqa: E402
from verst.envs.runner import EnvConfig, EnvironmentAgent, EpisodeError  # noqa: E402
from verst.envs.verifiers_connector import VerifiersEnvironment, task_reward  # noqa: E402
from verst.models.tiny import build_char_tokenizer  # noqa: E402
from verst.rollout.agent import run_agent_groups  # noqa: E402
from verst.types import Sample, Status  # noqa: E402

HERE = "tests.test_verifiers_connector"


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.isdigit())

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    task_cls: type[SumTask] = SumTask

    def load(self) -> Any:
        for a, b in [(1, 2), (3, 4), (10, 5), (7, 7)]:
            data = SumData(prompt=f"{a}+{b}=", answer=str(a + b), system_prompt="add")
            yield self.task_cls(data, self.config.task)


class BrokenTask(SumTask):
    @vf.reward
    async def exact(self, task: SumData, trace: vf.Trace) -> float:
        raise RuntimeError("the checker crashed")


class InBoxTask(SumTask):
    @vf.reward
    async def in_box(self, runtime: vf.Runtime) -> float:
        return 1.0


def broken_taskset() -> SumTaskset:
    taskset = SumTaskset(vf.TasksetConfig())
    taskset.task_cls = BrokenTask
    return taskset


def in_box_taskset() -> SumTaskset:
    taskset = SumTaskset(vf.TasksetConfig())
    taskset.task_cls = InBoxTask
    return taskset


def rows(taskset: str, split: str = "train", **kwargs: Any) -> list[dict[str, Any]]:
    return make_task("verifiers", split, 0, taskset=taskset, **kwargs)


def test_rows_are_the_tasks_and_the_splits_are_disjoint() -> None:
    train = rows(f"{HERE}:SumTaskset")
    assert [r["label"] for r in train] == ["3", "7", "15", "14"]
    assert train[0]["prompt"] == [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "1+2="},
    ]
    assert [r["vf_task_idx"] for r in train] == [0, 1, 2, 3]
    test = rows(f"{HERE}:SumTaskset", "test", test_size=1, dev_size=2)
    dev = rows(f"{HERE}:SumTaskset", "dev", test_size=1, dev_size=2)
    rest = rows(f"{HERE}:SumTaskset", "train", test_size=1, dev_size=2)
    assert [r["label"] for r in test + dev + rest] == ["3", "7", "15", "14"]
    with pytest.raises(ValueError, match="data.task_kwargs.taskset"):
        rows(f"{HERE}:no_such_taskset")
    with pytest.raises(ValueError, match="data.task_kwargs.size"):
        rows(f"{HERE}:SumTaskset", size=0)


def test_a_taskset_package_loads_by_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a colon, the name is a verifiers taskset id: a package exporting its Taskset
    via `__all__`, its config validated from `args`, as `vf.load_taskset` loads it."""
    (tmp_path / "vf_sums_pkg.py").write_text(
        "from examples.verifiers_addition import AdditionTaskset\n__all__ = ['AdditionTaskset']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    one_digit = rows("vf_sums_pkg", args={"digits": 1})
    assert len(one_digit) == 100
    assert all(
        int(r["label"]) == sum(map(int, r["prompt"][0]["content"][:-1].split("+")))
        for r in one_digit
    )
    with pytest.raises(ValueError, match="data.task_kwargs.taskset"):
        rows("vf_sums_pkg", args={"no_such_field": 1})


def play_row(cfg: EnvConfig, row: dict[str, Any], turns: list[dict[str, Any]]) -> Any:
    meta = {k: v for k, v in row.items() if k != "prompt"}
    return scripted(VerifiersEnvironment, cfg, row["prompt"], meta, turns)


def test_scripted_answers_get_the_tasks_weighted_rewards() -> None:
    cfg = EnvConfig(name="verifiers", options={"taskset": f"{HERE}:SumTaskset"})
    train = rows(f"{HERE}:SumTaskset")
    opening, [right], _ = play_row(cfg, train[0], [{"content": " 3\n"}])
    assert opening == train[0]["prompt"]
    assert right.done and right.reward == 1.5  # exact (1.0) + digits (0.5 x 1.0)
    assert right.info["vf_rewards"] == {"exact": 1.0, "digits": 1.0}
    assert right.info["vf_metrics"] == {"turns": 1.0}
    _, [wrong], _ = play_row(cfg, train[1], [{"content": "8"}])
    assert wrong.done and wrong.reward == 0.5 and wrong.info["vf_rewards"]["exact"] == 0.0
    _, [words], _ = play_row(cfg, train[2], [{"content": "fifteen"}])
    assert words.done and words.reward == 0.0


def test_task_reward_scores_single_turn_samples_with_the_tasks_rewards() -> None:
    train = rows(f"{HERE}:SumTaskset")

    def score(row: dict[str, Any], text: str) -> float:
        meta = {**{k: v for k, v in row.items() if k != "prompt"}, "response_text": text}
        return asyncio.run(task_reward(Sample(prompt=row["prompt"], metadata=meta)))

    assert score(train[0], "3") == 1.5 and score(train[1], "8") == 0.5
    assert score(train[2], "") == 0.0
    with pytest.raises(ValueError, match="no vf_taskset"):
        asyncio.run(task_reward(Sample(prompt="1+2=", metadata={"response_text": "3"})))


def test_rows_of_another_taskset_or_none_are_refused() -> None:
    cfg = EnvConfig(name="verifiers", options={"taskset": f"{HERE}:SumTaskset"})
    other = rows("examples.verifiers_addition:load_taskset", args={"digits": 1})
    with pytest.raises(ValueError, match="not env.options.taskset's task 0"):
        play_row(cfg, other[0], [])
    with pytest.raises(ValueError, match="no vf_task_idx"):
        scripted(VerifiersEnvironment, cfg, "1+2=", {}, [])
    with pytest.raises(ValueError, match="env.options.taskset"):
        scripted(VerifiersEnvironment, EnvConfig(name="verifiers"), "1+2=", {}, [])


def test_a_task_whose_reward_needs_a_runtime_is_refused() -> None:
    spec = f"{HERE}:in_box_taskset"
    cfg = EnvConfig(name="verifiers", options={"taskset": spec})
    with pytest.raises(ValueError, match="reward 'in_box' takes a runtime"):
        play_row(cfg, rows(spec)[0], [])


@pytest.mark.parametrize("on_error", ["observe", "abort"])
def test_a_reward_that_raises_follows_on_error(on_error: str) -> None:
    spec = f"{HERE}:broken_taskset"
    cfg = EnvConfig(name="verifiers", options={"taskset": spec}, on_error=on_error)
    row = rows(spec)[0]
    if on_error == "abort":
        with pytest.raises(EpisodeError, match="the checker crashed"):
            play_row(cfg, row, [{"content": "3"}])
        return
    _, [result], last = play_row(cfg, row, [{"content": "3"}])
    assert not result.done and result.reward == 0.0
    [message] = result.observation
    assert message["role"] == "user" and "the checker crashed" in message["content"]
    assert last is None  # the turns ran out; nothing more to score


def test_episodes_through_the_session_server(sessions_url: str) -> None:  # noqa: F811
    """A random tiny model answers through the session server; each sample's reward is what
    the task's rewards give its answer."""
    spec = f"{HERE}:SumTaskset"
    agent = EnvironmentAgent(EnvConfig(name="verifiers", options={"taskset": spec}))
    tokenizer = build_char_tokenizer()
    samples = []
    for i, row in enumerate(rows(spec)):
        meta = {k: v for k, v in row.items() if k not in ("prompt", "label")}
        tokens = tokenizer.encode(row["prompt"][-1]["content"])
        samples.append(
            Sample(prompt=row["prompt"], label=row["label"], tokens=tokens, index=i, metadata=meta)
        )
    asyncio.run(
        run_agent_groups(sessions_url, [samples], agent, KWARGS, timeout_s=30, max_concurrency=4)
    )
    for sample in samples:
        assert sample.status is not Status.ABORTED, sample.metadata
        meta = sample.metadata
        assert meta["num_turns"] == 1 and meta["env_steps"] == 1 and meta["env_done"]
        answer = meta["messages"][-1]["content"].strip()
        expected = float(answer == sample.label) + 0.5 * float(answer.isdigit())
        assert meta["env_reward"] == expected and meta["answer"] == answer
        assert meta["messages"][0] == {"role": "system", "content": "add"}


def test_verifiers_example_trains_through_the_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", "examples/verifiers_env.yaml", *QUICK, "--run-dir", str(run_dir)]) == 0
    records_ = records(run_dir)
    assert [r["step"] for r in records_] == [0, 1, 2]
    # the warm start's greedy dev check scored with the tasks' rewards (task_reward), no error
    assert 0.0 <= records_[0]["warm_start/dev_accuracy"] <= 1.0
    for row in records_[1:]:
        assert row["rollout/agent_aborted_ratio"] == 0.0
        assert row["rollout/num_samples"] == 8 and row["rollout/env_steps_mean"] == 1.0
        assert row["rollout/env_done_ratio"] == 1.0 and 0.0 <= row["rollout/reward_mean"] <= 1.0
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-4
