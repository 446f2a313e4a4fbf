"""Multi-LoRA (`model.lora.adapters`): several adapters trained in one run on one base, each on
its own prompts with its own reward and optimizer; a step trains and pushes only the adapters
that had samples; the engines serve them side by side in the trainer's log-probs; checkpoints
hold one peft directory per adapter and resume exactly; bad settings are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_loop import SMALL, records
from tests.test_lora import tiny_base
from tests.test_trainer import CPU, tiny_model
from tests.test_trainer import items as make_items
from verst.cli import main
from verst.config import ConfigError, load_config
from verst.models.lora import ADAPTER_WEIGHTS_FILE, LoraConfig, apply_lora, merge_adapter_dir
from verst.train.algorithms import LossConfig
from verst.train.checkpoint import list_checkpoints
from verst.train.trainer import Trainer, TrainerConfig

pytest.importorskip("peft")

SHAPE = [a for a in SMALL if not a.startswith(("model.tiny=", "warm_start"))]
TWO_ADAPTERS = (
    "model.lora={rank: 8, alpha: 16, adapters: ["
    "{name: add, data: {task: addition},"
    " eval_data: {task: addition, split: test, max_prompts: 8, shuffle: false}},"
    "{name: tt, data: {path: examples/data/times_tables.jsonl}, lr: 2e-2,"
    " reward: 'examples.custom_reward:product_reward',"
    " eval_data: {path: examples/data/times_tables.jsonl, max_prompts: 8, shuffle: false}}]}"
)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_base(tmp_path_factory.mktemp("multi_lora") / "base")


def run_args(base: Path, *extra: str) -> list[str]:
    return [
        "train",
        *SHAPE,
        f"model.path={base}",
        TWO_ADAPTERS,
        "rollout.reward=tests.restart_rewards:response_chars",  # rewards differ in a group
        "trainer.lr=1e-2",
        "checkpoint.interval_steps=2",
        *extra,
    ]


def adapter_bytes(checkpoint: Path, name: str) -> int:
    saved = load_file(checkpoint / name / ADAPTER_WEIGHTS_FILE)
    return sum(t.numel() * t.element_size() for t in saved.values())


def test_two_adapters_train_on_their_own_data_and_resume_exactly(
    base: Path, tmp_path: Path
) -> None:
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert main([*run_args(base), "--run-dir", str(straight)]) == 0
    rows = records(straight)
    assert {"eval/add/accuracy", "eval/tt/accuracy", "eval/accuracy"} <= rows[0].keys()
    checkpoint = list_checkpoints(straight)[-1]
    sizes = {name: adapter_bytes(checkpoint, name) for name in ("add", "tt")}
    for row in rows[1:]:
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-5, row  # on-policy, per adapter
        stepped = [name for name in sizes if f"train/{name}/loss" in row]
        assert stepped, row
        assert row["sync/bytes"] == sum(sizes[name] for name in stepped), row
    # the adapters saw different prompts and rewards: times tables never pay response_chars
    assert any(r["train/add/grad_norm"] > 0 for r in rows[1:])

    assert main([*run_args(base, "num_steps=2"), "--run-dir", str(interrupted)]) == 0
    assert main([*run_args(base), "--run-dir", str(interrupted), "--resume"]) == 0
    resumed = {r["step"]: r for r in records(interrupted)}
    for row in rows[3:]:
        assert resumed[row["step"]]["train/loss"] == pytest.approx(row["train/loss"], abs=1e-6)

    merged = tmp_path / "merged"
    merge_adapter_dir(base, checkpoint / "tt", merged)  # each adapter is a peft directory
    assert (merged / "config.json").is_file()


def test_serving_engine_processes_serve_both_adapters(base: Path, tmp_path: Path) -> None:
    """Engine processes hold the frozen base and both adapters (broadcast), one batch mixing
    them: the trainer's log-probs match theirs for every adapter."""
    args = run_args(
        base,
        "num_steps=2",
        "eval.interval_steps=0",
        "placement.engines=processes",
        "sync.transport=broadcast",
    )
    assert main([*args, "--run-dir", str(tmp_path / "run")]) == 0
    for row in records(tmp_path / "run")[1:]:
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-5, row


def test_a_step_trains_only_the_adapters_that_had_samples() -> None:
    """Items of adapter `a` alone: `a` moves, `b` keeps its weights and has no optimizer
    state; then `b`'s items move `b` with its own learning rate."""
    model = tiny_model()
    lora = LoraConfig.model_validate(
        {
            "rank": 4,
            "adapters": [
                {"name": "a", "data": {"task": "addition"}},
                {"name": "b", "data": {"task": "addition"}},
            ],
        }
    )
    apply_lora(model, lora)
    with torch.no_grad():  # B = 0 would make every A gradient 0
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.1)
    cfg = TrainerConfig(lr=1e-2, device="cpu")
    adapter_lrs = {"a": 1e-2, "b": 1e-3}
    trainer = Trainer(
        model,
        cfg,
        LossConfig(),
        total_steps=10,
        pad_token_id=0,
        device=CPU,
        adapter_lrs=adapter_lrs,
    )

    def weights(adapter: str) -> dict[str, torch.Tensor]:
        return {
            n: p.detach().clone()
            for n, p in trainer.model.named_parameters()
            if f".{adapter}." in n
        }

    before_a, before_b = weights("a"), weights("b")
    batch = make_items()
    for item in batch:
        item.adapter = "a"
    metrics = trainer.step(batch, step=1)
    assert trainer.stepped_adapters == ["a"]
    assert "train/a/loss" in metrics and "train/b/loss" not in metrics
    assert any(not torch.equal(before_a[n], w) for n, w in weights("a").items())
    assert all(torch.equal(before_b[n], w) for n, w in weights("b").items())
    assert not trainer.adapter_optimizers["b"][0].state
    for item in batch:
        item.adapter = "b"
    metrics = trainer.step(batch, step=2)
    assert trainer.stepped_adapters == ["b"] and metrics["train/b/lr"] <= 1e-3
    assert any(not torch.equal(before_b[n], w) for n, w in weights("b").items())


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lora.rank=0", "rank must be >= 1"),
        (TWO_ADAPTERS.replace("name: tt", "name: add"), "names must be distinct"),
        ("data.task=times", "leave the top-level data unset"),
        ("loss.kl_loss_coef=0.1", "KL reference"),
        ("warm_start.enabled=true", "verst sft"),
    ],
)
def test_bad_multi_lora_settings_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [TWO_ADAPTERS, override])


def test_an_adapter_name_must_suit_paths_and_requests() -> None:
    bad = "model.lora={rank: 4, adapters: [{name: 'a/b', data: {task: addition}}]}"
    with pytest.raises(ConfigError, match="name"):
        load_config(None, [bad])


def test_one_adapter_of_multi_lora_trains_as_plain_lora(base: Path, tmp_path: Path) -> None:
    """The same data, seed and settings as one adapter of `model.lora.adapters` or as plain
    `model.lora`: the same tokens sampled, the same losses and gradient norms, step by step
    (the engine's registry computes what the embedded engine's peft layers compute)."""
    common = [*run_args(base, "num_steps=3", "eval.interval_steps=0")]
    common.remove(TWO_ADAPTERS)
    plain = [*common, "model.lora={rank: 8, alpha: 16}", "data={task: addition}"]
    one = [
        *common,
        "model.lora={rank: 8, alpha: 16, adapters: [{name: add, data: {task: addition}}]}",
    ]
    assert main([*plain, "--run-dir", str(tmp_path / "plain")]) == 0
    assert main([*one, "--run-dir", str(tmp_path / "one")]) == 0
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm")
    for a, b in zip(records(tmp_path / "plain")[1:], records(tmp_path / "one")[1:], strict=True):
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], rel=1e-5, abs=1e-7)


RECIPE = Path(__file__).parent.parent / "examples" / "multi_lora.yaml"


def test_multi_lora_recipe_loads_and_runs_two_steps(base: Path, tmp_path: Path) -> None:
    """examples/multi_lora.yaml on a random tiny base and a tiny batch (its learning is measured
    in docs/training.md): both adapters train, evaluate and are checkpointed."""
    cfg = load_config(RECIPE, [f"model.path={base}"])
    assert [a.name for a in cfg.model.lora.adapters] == ["add", "sub"]
    tiny = ["num_steps=2", "num_threads=1", "trainer.device=cpu", "eval.interval_steps=2"]
    tiny += ["rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4"]
    run_dir = tmp_path / "run"
    args = ["train", str(RECIPE), f"model.path={base}", *tiny, "--run-dir", str(run_dir)]
    assert main(args) == 0
    rows = records(run_dir)
    assert {"eval/add/accuracy", "eval/sub/accuracy"} <= rows[-1].keys()
    assert {p.name for p in list_checkpoints(run_dir)[-1].iterdir() if p.is_dir()} == {"add", "sub"}
