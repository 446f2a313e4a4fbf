"""On-policy distillation (`loss.opd`): the advantage update against its closed form, teacher
choice per sample, teacher scoring on real loopback servers, bad teachers refused at start,
`verst train` with a `verst serve` teacher process, with and without a reward, and the first
steps of examples/distill.yaml."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from verst.config import ConfigError, load_config
from verst.train.advantages import opd_advantages
from verst.train.algorithms import LossConfig
from verst.train.batching import TrainItem, collate
from verst.train.objective import set_token_advantages, whiten_globally
from verst.train.opd import OPDConfig, teacher_name
from verst.types import Sample

pytest.importorskip("aiohttp")

from tests.servers import LoopThread, start_engine, tiny_model  # noqa: E402
from tests.test_loop import SMALL  # noqa: E402
from verst.cli import main  # noqa: E402
from verst.fleet.client import HttpEngineClient  # noqa: E402
from verst.fleet.launcher import free_port, launch_local_engines  # noqa: E402
from verst.models.tiny import build_char_tokenizer  # noqa: E402
from verst.rollout.teacher import TeacherConfigError, TeacherError, TeacherScorer  # noqa: E402

CPU = torch.device("cpu")


# ---------------------------------------------------------------- the math


def test_opd_advantages_closed_form() -> None:
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
    teacher = torch.tensor([[-2.0, -1.0, -0.5], [-0.2, -0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    got = opd_advantages(advantages, student, teacher, mask, coef=0.5)
    # A - 0.5 (s - t), 0 where masked
    want = torch.tensor([[1.0 - 0.5, 1.0 + 0.5, 0.0], [-0.5 - 0.05, 0.0, -0.5 - 4.0]])
    assert torch.allclose(got, want)
    zero = opd_advantages(advantages, student, teacher, mask, coef=0.0)
    assert torch.equal(zero, advantages * mask)


def _item(reward: float, student: list[float], teacher: list[float], mask: list[int]) -> TrainItem:
    tokens = [5, 6, *range(10, 10 + len(student))]
    return TrainItem(tokens, len(student), mask, student, 0.0, reward, teacher)


def test_the_trainer_moves_token_advantages_after_the_estimator() -> None:
    """GRPO's group advantages, then −c(s − t) per token (a masked token stays 0)."""
    loss = LossConfig(opd=OPDConfig(coef=2.0, teacher_urls={"default": "http://127.0.0.1:1"}))
    items = [
        _item(1.0, [-1.0, -1.0], [-0.5, -3.0], [1, 1]),
        _item(0.0, [-2.0, -0.1], [-2.0, -0.6], [1, 0]),
    ]
    items[0].advantage, items[1].advantage = 0.7, -0.7  # as the loop's sample_advantages gives
    micro = collate(items, pad_token_id=0, device=CPU)
    set_token_advantages(loss, micro, torch.zeros_like(micro.loss_mask_B_T), None)
    want = torch.tensor([[0.7 - 2 * (-0.5), 0.7 - 2 * 2.0], [-0.7 - 0.0, 0.0]])
    assert torch.allclose(micro.advantages_B_T, want)


def test_whitening_comes_after_the_teacher() -> None:
    """reinforce++ whitens the advantages the teacher has already moved."""
    loss = LossConfig(
        advantage_estimator="reinforce_plus_plus",
        opd=OPDConfig(coef=1.0, teacher_urls={"default": "http://127.0.0.1:1"}),
    )
    items = [_item(1.0, [-1.0, -1.0, -1.0], [-1.0, -4.0, -0.5], [1, 1, 1])]
    micro = collate(items, pad_token_id=0, device=CPU)
    set_token_advantages(loss, micro, torch.zeros_like(micro.loss_mask_B_T), None)
    moved = torch.tensor([[1.0, 1.0 - 3.0, 1.0 + 0.5]])  # returns 1 on each token, then −(s − t)
    assert torch.allclose(micro.advantages_B_T, moved)
    whiten_globally([micro], CPU)
    assert torch.allclose(micro.advantages_B_T, (moved - moved.mean()) / (moved.std() + 1e-8))


def test_each_sample_picks_its_teacher() -> None:
    teachers = {"default": "http://a", "math": "http://b"}
    assert teacher_name(Sample(), teachers) == "default"
    assert teacher_name(Sample(metadata={"opd_teacher": "math"}), teachers) == "math"
    with pytest.raises(ValueError, match="opd_teacher='code' is not in loss.opd.teacher_urls"):
        teacher_name(Sample(metadata={"opd_teacher": "code"}), teachers)
    with pytest.raises(ValueError, match="has no 'default' teacher"):
        teacher_name(Sample(), {"math": "http://b"})


def test_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ConfigError, match="loss.opd.teacher_urls: name at least one teacher"):
        load_config(None, ["loss.opd={coef: 1.0}"])
    with pytest.raises(ConfigError, match="loss.opd.teacher_urls.t: 'localhost:1' is not"):
        load_config(None, ["loss.opd.teacher_urls.t=localhost:1"])
    with pytest.raises(ConfigError, match="rollout.reward=none: with no reward"):
        load_config(None, ["rollout.reward=none"])
    teacher = "loss.opd.teacher_urls.default=http://127.0.0.1:1"
    with pytest.raises(ConfigError, match="eval.reward: evaluation scores"):
        load_config(None, ["rollout.reward=none", teacher, "eval.interval_steps=1"])
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        load_config(None, ["rollout.reward=none", teacher, "rollout.dynamic_sampling=true"])
    cfg = load_config(None, ["rollout.reward=none", teacher, "eval.reward=exact_match"])
    assert cfg.loss.opd is not None and cfg.loss.opd.coef == 1.0


# ---------------------------------------------------------------- teachers on loopback servers


@pytest.fixture(scope="module")
def two_teachers(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("teachers")
    engines = [loop.run(start_engine(tiny_model(root, f"t{seed}", seed=seed))) for seed in (1, 2)]
    yield {"default": engines[0].url, "other": engines[1].url}
    for engine in engines:
        loop.run(engine.runner.cleanup())
        loop.run(engine.serving.stop())


def _sample(prompt: str, response: str, **metadata: str) -> Sample:
    tokenizer = build_char_tokenizer()
    prompt_ids, response_ids = tokenizer.encode(prompt), tokenizer.encode(response)
    return Sample(
        tokens=prompt_ids + response_ids,
        response_length=len(response_ids),
        loss_mask=[1] * len(response_ids),
        rollout_logprobs=[-1.0] * len(response_ids),
        metadata=dict(metadata),
    )


def _prefill_from_start(url: str, tokens: list[int]) -> list[float]:
    """The teacher's log-prob of every token after the first, scored from position 0."""

    async def prefill() -> dict:
        client = HttpEngineClient(url)
        try:
            return await client.generate(
                {
                    "input_ids": tokens,
                    "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                }
            )
        finally:
            await client.close()

    return [triple[0] for triple in asyncio.run(prefill())["meta_info"]["input_token_logprobs"][1:]]


def test_teachers_score_the_response_tokens_of_their_samples(two_teachers: dict) -> None:
    """Each sample is scored by its own teacher, exactly as a full-prompt prefill scores it."""
    scorer = TeacherScorer(
        OPDConfig(teacher_urls=two_teachers), build_char_tokenizer().encode, temperature=1.0
    )
    scorer.check()
    groups = [
        [_sample("12+30=", "42"), _sample("12+30=", "421", opd_teacher="other")],
        [_sample("7", "x y", opd_teacher="default")],
    ]
    metrics = scorer.score_groups(groups, CPU)
    for sample, teacher in [(groups[0][0], "default"), (groups[0][1], "other")]:
        assert sample.teacher_logprobs is not None
        want = _prefill_from_start(two_teachers[teacher], sample.tokens)
        assert sample.teacher_logprobs == pytest.approx(want[-sample.response_length :], abs=1e-5)
    # the two teachers are different models: the same tokens get different scores
    assert groups[0][0].teacher_logprobs != groups[0][1].teacher_logprobs[:2]
    samples = [s for g in groups for s in g]
    s_minus_t = [-1.0 - t for s in samples for t in s.teacher_logprobs]
    assert metrics["opd/reverse_kl"] == pytest.approx(sum(s_minus_t) / len(s_minus_t))


def test_a_teacher_that_stops_answering_names_its_field() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    scorer = TeacherScorer(
        OPDConfig(teacher_urls={"math": url}), build_char_tokenizer().encode, temperature=1.0
    )
    with pytest.raises(TeacherConfigError, match=r"loss.opd.teacher_urls.math: .* does not answer"):
        scorer.check()
    sample = _sample("1+1=", "2", opd_teacher="math")
    with pytest.raises(TeacherError, match=r"loss.opd.teacher_urls.math: .* does not answer"):
        scorer.score_groups([[sample]], CPU)


# ---------------------------------------------------------------- verst train


def _run(tmp_path: Path, *overrides: str, name: str = "run") -> list[dict]:
    run_dir = tmp_path / name
    assert main(["train", *SMALL, *overrides, "--run-dir", str(run_dir)]) == 0
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


QUICK = [
    "num_steps=2",
    "eval.interval_steps=0",
    "warm_start.enabled=false",
    "checkpoint.interval_steps=0",
]


def test_train_refuses_an_unreachable_teacher(tmp_path: Path, capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    args = ["train", *SMALL, *QUICK, f"loss.opd.teacher_urls.default={url}"]
    assert main([*args, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "loss.opd.teacher_urls.default" in err and "does not answer" in err


def test_train_refuses_a_teacher_with_another_tokenizer(
    tmp_path: Path, loop: LoopThread, capsys
) -> None:
    model_dir = tiny_model(tmp_path, "teacher")
    tokenizer_file = model_dir / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    vocab = spec["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]  # same size, two digits swapped
    tokenizer_file.write_text(json.dumps(spec))
    engine = loop.run(start_engine(model_dir))
    try:
        args = ["train", *SMALL, *QUICK, f"loss.opd.teacher_urls.default={engine.url}"]
        assert main([*args, "--run-dir", str(tmp_path / "run")]) == 2
    finally:
        loop.run(engine.runner.cleanup())
        loop.run(engine.serving.stop())
    err = capsys.readouterr().err
    assert "loss.opd.teacher_urls.default" in err and "another tokenizer" in err


@pytest.fixture(scope="module")
def teacher_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `verst serve` process of a tiny model of its own (another seed than the student)."""
    model_dir = tiny_model(tmp_path_factory.mktemp("teacher"), seed=7)
    (engine,) = launch_local_engines(
        model_dir, 1, extra_args=["--device", "cpu", "--num-threads", "1"], timeout_s=60
    )
    yield engine.url
    engine.stop()


@pytest.mark.parametrize(
    "mode",
    [
        ["rollout.reward=none"],  # pure distillation
        ["loss.opd.coef=0.5"],  # distillation + RL (exact_match)
        pytest.param(
            ["rollout.reward=none", "trainer.backend=megatron"],
            marks=pytest.mark.skipif(find_spec("megatron") is None, reason="needs megatron-core"),
        ),
    ],
    ids=["distillation", "distillation+rl", "megatron"],
)
def test_train_distils_from_a_served_teacher(
    tmp_path: Path, teacher_process: str, mode: list[str]
) -> None:
    rows = _run(tmp_path, *QUICK, f"loss.opd.teacher_urls.default={teacher_process}", *mode)
    assert len(rows) == 3
    for row in rows[1:]:
        assert math.isfinite(row["opd/reverse_kl"]), row
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0, row
        assert "perf/teacher_time_s" in row


def test_distill_recipe_runs_its_first_steps(tmp_path: Path, teacher_process: str) -> None:
    """examples/distill.yaml, pure distillation from a `verst serve` teacher process: its warm
    start, evaluation and first steps run, and every step is scored by the teacher."""
    recipe = Path(__file__).parent.parent / "examples" / "distill.yaml"
    run_dir = tmp_path / "run"
    args = [
        "train",
        str(recipe),
        "num_steps=2",
        "trainer.device=cpu",
        f"loss.opd.teacher_urls.default={teacher_process}",
        "warm_start.max_steps=2",
        "warm_start.dev_data.max_prompts=8",
        "eval.data.max_prompts=8",
        "--run-dir",
        str(run_dir),
    ]
    assert main(args) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["warm_start/steps"] == 2 and rows[-1]["eval/num_prompts"] == 8
    for row in rows[1:]:
        assert row["rollout/reward_mean"] == 0.0, row  # rollout.reward: none
        assert math.isfinite(row["opd/reverse_kl"]) and row["opd/reverse_kl"] != 0.0, row
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0, row
