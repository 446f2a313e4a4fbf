"""The rollout's plug-in layers through `verst train`: a rollout function, a generate function,
a group reward served over HTTP (a real aiohttp server on loopback) and a group filter; and
what a reward that fails, hangs or lies does to its samples (never to the run)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_loop import SMALL, records
from verst.cli import main
from verst.config import ConfigError, load_config
from verst.fleet.loop_thread import LoopThread
from verst.plugins import RolloutContext, RolloutRequest, RolloutResult
from verst.rollout.ledger import read_ledger
from verst.rollout.rewards import RewardScorer, exact_match
from verst.types import Group, Sample, Status

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

HERE = "tests.test_plugin_layers"
ROOT = Path(__file__).resolve().parents[1]


def train(tmp_path: Path, *overrides: str) -> tuple[list[dict], Path]:
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, "num_steps=2", *overrides, "--run-dir", str(run_dir)]) == 0
    return records(run_dir), run_dir


def reasons(run_dir: Path) -> set[str]:
    return {line["reason"] for line in read_ledger(run_dir / "prompts.jsonl")}


@pytest.fixture
def repo(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(ROOT)  # so `examples.` imports
    return ROOT


# ---- plug-ins of this module ----------------------------------------------------------------


def even_prompts_out(group: Group) -> str | None:
    return "even prompt" if (group[0].prompt_id or 0) % 2 == 0 else None


async def async_rollout(context: RolloutContext, request: RolloutRequest) -> RolloutResult:
    prompts = request.prompts or context.take(context.prompts_per_step)
    return RolloutResult(context.generate(prompts), {"rollout/mine": 1.0})


EVAL_CALLS: list[tuple[int, int, int, int]] = []


def recording_rollout(context: RolloutContext, request: RolloutRequest) -> RolloutResult:
    """Records each evaluation call; leaves its samples unscored (the set's reward scores
    them), and fails the evaluation of step 2."""
    if request.prompts is None:
        groups = context.generate(context.take(context.prompts_per_step))
        context.score(groups)
        return RolloutResult(groups)
    if request.step == 2:
        raise RuntimeError("the evaluation's environment is down")
    params = context.params
    EVAL_CALLS.append(
        (request.step, request.weight_version, len(request.prompts), params.max_new_tokens)
    )
    return RolloutResult(context.generate(request.prompts))


def bad_rollout(context: RolloutContext, request: RolloutRequest) -> list:
    return context.generate(context.take(1))  # a list, not a RolloutResult


def two_args(group: Group, extra: int) -> str | None:
    return None


async def first_sample_fails_on_even_prompts(engine, sample, params, decode) -> Sample:
    from examples.generate_function import two_turns

    if sample.index == 0 and (sample.prompt_id or 0) % 2 == 0:
        raise ConnectionError("the environment went away")
    return await two_turns(engine, sample, params, decode)


# ---- the four layers through verst train ------------------------------------------------------


def test_rollout_function_owns_the_step(tmp_path: Path, repo: Path) -> None:
    rows, run_dir = train(tmp_path, "rollout.function=examples.rollout_function:skip_solved")
    for row in rows[1:]:
        assert 1 <= row["rollout/skip_solved_rounds"] <= 3
        assert row["rollout/num_samples"] > 0 and "train/loss" in row
    rows, _ = train(tmp_path / "async", f"rollout.function={HERE}:async_rollout")
    assert all(row["rollout/mine"] == 1.0 for row in rows[1:])


def test_the_rollout_function_also_evaluates(tmp_path: Path) -> None:
    EVAL_CALLS.clear()
    overrides = [f"rollout.function={HERE}:recording_rollout", "eval.max_new_tokens=3"]
    rows, run_dir = train(tmp_path, "num_steps=3", *overrides)
    versions = {row["step"]: row["weight_version"] for row in rows}
    # points at steps 0 and 3 (the last); step 2's raised: skipped, and the run went on
    assert EVAL_CALLS == [(0, versions[0], 8, 3), (3, versions[3], 8, 3)]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert rows[2]["eval/skipped_crashed"] == 1 and "down" in rows[2]["eval/skip_detail"]
    for row in (rows[0], rows[3]):
        assert row["eval/num_prompts"] == 8 and 0 <= row["eval/accuracy"] <= 1
        assert row["eval/response_len_mean"] <= 3
        assert row["eval/weight_version/mean"] == row["weight_version"]


def test_a_rollout_function_that_returns_the_wrong_shape_stops_the_run(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"rollout\.function .* not a verst\.plugins\.RolloutResult"
    ):
        train(tmp_path, f"rollout.function={HERE}:bad_rollout")


def test_generate_function_plays_two_turns(tmp_path: Path, repo: Path) -> None:
    from examples.generate_function import FEEDBACK

    rows, _ = train(tmp_path, "rollout.generate_function=examples.generate_function:two_turns")
    for row in rows[1:]:
        # two answers of at least one token each around the environment's reply
        assert row["rollout/response_len_mean"] >= len(FEEDBACK) + 2
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-4  # masked tokens left out


def test_filter_drops_groups_with_its_reason(tmp_path: Path, repo: Path) -> None:
    rows, run_dir = train(tmp_path, f"rollout.filter={HERE}:even_prompts_out")
    assert sum(row.get("rollout/filter/drop_even_prompt", 0) for row in rows[1:]) > 0
    assert "filter: even prompt" in reasons(run_dir)
    rows, run_dir = train(tmp_path / "example", "rollout.filter=examples.sample_filter:informative")
    assert all(1 <= row["rollout/dynamic_sampling_rounds"] <= 4 for row in rows[1:])


class Scorer:
    """The example HTTP group scorer on loopback, counting the groups posted to it; with
    `fail_every`, every so many groups answer 500."""

    def __init__(self, fail_every: int | None = None) -> None:
        from examples.group_reward import handle

        self.posts: list[dict] = []
        self.fail_every = fail_every

        async def counted(request: web.Request) -> web.Response:
            self.posts.append(await request.json())
            if self.fail_every and len(self.posts) % self.fail_every == 0:
                return web.json_response({"error": "scorer overloaded"}, status=500)
            return await handle(request)

        self.app = web.Application()
        self.app.router.add_post("/score", counted)


@pytest.fixture
def serve(repo: Path) -> Iterator:
    loop = LoopThread("test-scorer")
    runners = []

    def start(scorer: Scorer) -> str:
        async def up() -> str:
            runner = web.AppRunner(scorer.app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            port = runner.addresses[0][1]
            return f"http://127.0.0.1:{port}/score"

        return loop.run(up())

    yield start
    for runner in runners:
        loop.run(runner.cleanup())
    loop.close()


def test_a_judge_served_by_verst_serve_scores_each_group(
    tmp_path: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`examples/judge_group_reward.py`: a reward model behind `verst serve` (a tiny judge of
    the policy's tokenizer) scores each response by its likelihood, centred per group."""
    from verst.fleet.launcher import free_port, launch_local_engines
    from verst.models.tiny import TinyModelConfig, create_tiny

    judge_dir = tmp_path / "judge"
    shape = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    create_tiny(judge_dir, TinyModelConfig(**shape), seed=1)
    judge_args = ["--device", "cpu", "--num-threads", "1"]
    judged = "rollout.group_reward=examples.judge_group_reward:judge_likelihood"
    (judge,) = launch_local_engines(judge_dir, 1, extra_args=judge_args, timeout_s=120)
    with judge:
        monkeypatch.setenv("VERST_JUDGE_URL", judge.url)
        rows, _ = train(tmp_path / "judged", judged, "eval.interval_steps=0")
    for row in rows[1:]:
        assert row["rollout/reward_errors"] == 0 and "train/loss" in row
        assert abs(row["rollout/reward_mean"]) < 1e-6  # each group's rewards sum to 0
        assert row["rollout/zero_std_ratio"] < 1  # the judge tells the answers apart

    monkeypatch.setenv("VERST_JUDGE_URL", f"http://127.0.0.1:{free_port()}")  # nobody there
    rows, _ = train(tmp_path / "unreachable", judged, "eval.interval_steps=0")
    assert [row["step"] for row in rows] == [0, 1, 2]  # every sample failed; the run went on
    assert all(row["rollout/reward_errors"] == 4 * 4 for row in rows[1:])


def test_http_group_reward_scores_each_group_in_one_post(tmp_path: Path, serve) -> None:
    scorer = Scorer()
    url = serve(scorer)
    rows, _ = train(tmp_path, "rollout.group_reward=http", f"rollout.group_reward_url={url}")
    groups_scored = 2 * 4  # steps × prompts_per_step
    assert len(scorer.posts) == groups_scored
    assert all(len(body["responses"]) == 4 for body in scorer.posts)
    assert all(0.0 <= row["rollout/reward_mean"] <= 1.5 for row in rows[1:])
    assert sum(row["rollout/reward_errors"] for row in rows[1:]) == 0


def test_a_failing_scorer_fails_its_samples_not_the_run(tmp_path: Path, serve) -> None:
    url = serve(Scorer(fail_every=3))
    rows, run_dir = train(tmp_path, "rollout.group_reward=http", f"rollout.group_reward_url={url}")
    assert [row["step"] for row in rows] == [0, 1, 2]
    # each group the scorer refused lost all 4 samples, and its prompt was served again
    assert sum(row["rollout/reward_errors"] for row in rows[1:]) % 4 == 0
    assert sum(row["rollout/reward_errors"] for row in rows[1:]) >= 4
    assert "too few scored samples" in reasons(run_dir)


# ---- group rewards that fail, hang or lie ------------------------------------------------------


def group_of(n: int) -> Group:
    return [
        Sample(tokens=[1, 2], response_length=1, status=Status.COMPLETED, index=i) for i in range(n)
    ]


def score(group_fn, group: Group, timeout_s: float | None = 0.3) -> RewardScorer:
    scorer = RewardScorer(exact_match, timeout_s=timeout_s, group_fn=group_fn)
    scorer.score_groups([group])
    return scorer


@pytest.mark.parametrize(
    ("group_fn", "reason"),
    [
        (lambda g: 1 / 0, "ZeroDivisionError: division by zero"),
        (lambda g: [1.0], "group reward returned 1, not 3 rewards"),
        (lambda g: "1,1,1", "group reward returned str, not 3 rewards"),
    ],
)
def test_a_group_reward_that_raises_or_miscounts_fails_the_group(group_fn, reason: str) -> None:
    group = group_of(3)
    scorer = score(group_fn, group)
    assert [s.status for s in group] == [Status.FAILED] * 3
    assert all(s.reward == 0.0 and s.metadata["reward_error"] == reason for s in group)
    assert scorer.take_failed() == 3


def test_a_hanging_group_reward_times_out() -> None:
    async def hangs(group: Group) -> list[float]:
        await asyncio.sleep(30)
        return [1.0] * len(group)

    group = group_of(2)
    score(hangs, group, timeout_s=0.2)
    assert [s.metadata["reward_error"] for s in group] == ["reward timed out after 0.2 s"] * 2


def test_a_bad_entry_fails_only_its_sample() -> None:
    group = group_of(4)
    group[3].status = Status.ABORTED  # not scored at all: not sent, reward 0
    sent: list[int] = []

    def rewards(g: Group) -> list:
        sent.append(len(g))
        return [1.0, math.nan, "high"]

    scorer = score(rewards, group)
    assert sent == [3]
    assert group[0].reward == 1.0 and group[0].status == Status.COMPLETED
    assert [s.status for s in group[1:]] == [Status.FAILED, Status.FAILED, Status.ABORTED]
    assert group[1].metadata["reward_error"] == "reward function returned non-finite nan"
    assert "not a number" in group[2].metadata["reward_error"]
    assert scorer.take_failed() == 2


# ---- bad config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.function=examples.no_such_module:fn", r"rollout\.function: cannot load"),
        (
            f"rollout.function={HERE}:even_prompts_out",
            r"rollout\.function: .* must take \(context, request\)",
        ),
        (
            f"rollout.generate_function={HERE}:even_prompts_out",
            r"rollout\.generate_function: .*async def",
        ),
        (f"rollout.filter={HERE}:two_args", r"rollout\.filter: .* must take \(group\)"),
        ("rollout.filter=no_such_filter", r"rollout\.filter: unknown filter"),
        (
            "rollout.group_reward=http",
            r"rollout\.group_reward: 'http' needs rollout\.group_reward_url",
        ),
        (f"rollout.group_reward={HERE}:Nope", r"rollout\.group_reward: cannot load"),
    ],
)
def test_bad_plugins_are_config_errors_naming_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_two_layers_for_one_part_are_refused() -> None:
    both = [
        f"rollout.function={HERE}:async_rollout",
        "rollout.generate_function=examples.generate_function:two_turns",
    ]
    with pytest.raises(ConfigError, match="rollout.function and rollout.generate_function"):
        load_config(None, both)
    with pytest.raises(ConfigError, match="in place of rollout.reward"):
        load_config(
            None,
            [
                "rollout.group_reward=http",
                "rollout.group_reward_url=http://x",
                "rollout.reward=numeric_match",
            ],
        )
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling is the filter"):
        load_config(
            None, ["rollout.dynamic_sampling=true", f"rollout.filter={HERE}:even_prompts_out"]
        )


@pytest.mark.parametrize("mode", ["sync", pytest.param("fully_async", marks=pytest.mark.slow)])
def test_an_aborted_sample_leaves_its_group_in_both_modes(
    tmp_path: Path, repo: Path, mode: str
) -> None:
    """One rule in both modes: a group keeps its scored samples and is trained when at least
    `rollout.min_scored_samples` remain (the aborted one is left out); with fewer, its prompt
    is served again."""
    from tests.test_fully_async import ASYNC

    fails = f"rollout.generate_function={HERE}:first_sample_fails_on_even_prompts"
    modes = [*ASYNC, "num_steps=2"] if mode == "fully_async" else []
    rows, run_dir = train(tmp_path, *modes, fails, "eval.interval_steps=0")
    lines = read_ledger(run_dir / "prompts.jsonl")
    trained = {x["prompt_id"] for x in lines if x["outcome"] == "trained"}
    assert any(p % 2 == 0 for p in trained) and any(p % 2 for p in trained)
    assert not {x["reason"] for x in lines} & {"aborted", "too few scored samples"}
    assert all(row["buffer/dropped_aborted"] == 0 for row in rows[1:] if mode == "fully_async")
    # the aborted samples are in the step's groups, one of 4 in an even prompt's group
    assert 0 < sum(row["rollout/aborted_ratio"] for row in rows[1:]) / (len(rows) - 1) < 0.25

    rows, run_dir = train(
        tmp_path / "all", *modes, fails, "eval.interval_steps=0", "rollout.min_scored_samples=4"
    )
    lines = read_ledger(run_dir / "prompts.jsonl")
    trained = {x["prompt_id"] for x in lines if x["outcome"] == "trained"}
    assert trained and all(p % 2 for p in trained)
    few = [x for x in lines if x["reason"] == "too few scored samples"]
    assert few and all(x["prompt_id"] % 2 == 0 and x["outcome"] == "retried" for x in few)


@pytest.mark.slow
def test_the_layers_in_fully_async_mode(tmp_path: Path, serve) -> None:
    """Generate function, filter and HTTP group reward on the worker of a fully async run."""
    from examples.generate_function import FEEDBACK
    from tests.test_fully_async import ASYNC

    scorer = Scorer()
    url = serve(scorer)
    rows, run_dir = train(
        tmp_path,
        *ASYNC,
        "num_steps=3",
        "rollout.generate_function=examples.generate_function:two_turns",
        f"rollout.filter={HERE}:even_prompts_out",
        "rollout.group_reward=http",
        f"rollout.group_reward_url={url}",
    )
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(row["rollout/response_len_mean"] >= len(FEEDBACK) + 2 for row in rows[1:])
    assert len(scorer.posts) >= 3 * 4  # every group the worker finished was posted
    assert sum(row.get("rollout/filter/drop_even_prompt", 0) for row in rows[1:]) > 0
    assert "filter: even prompt" in reasons(run_dir)
    trained = [x for x in read_ledger(run_dir / "prompts.jsonl") if x["outcome"] == "trained"]
    assert trained and all(x["prompt_id"] % 2 == 1 for x in trained)
