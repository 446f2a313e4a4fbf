"""True on-policy mode (`trainer.true_on_policy`): the engine's sampled log-probs equal the
trainer's bitwise, whatever the batch, through `verst train` in sync and fully async modes;
what cannot guarantee it is refused, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_batch_invariant import tiny
from verst.cli import main
from verst.config import ConfigError, load_config
from verst.engine import GenerateRequest, SamplingParams, Scheduler
from verst.train.batching import TrainItem, collate
from verst.train.on_policy import invariant_scores

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [12], [20, 21, 22, 23, 24], [3] * 17]
TINY = (
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 64, max_position_embeddings: 32}"
)
RUN = [
    "num_steps=3",
    "trainer.device=cpu",
    "num_threads=1",
    TINY,
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "trainer.lr=1e-2",
    "loss.entropy_coef=0.1",  # a gradient every step, even when every reward is equal
    "trainer.true_on_policy=true",
]


def engine(model: torch.nn.Module, max_running: int) -> Scheduler:
    return Scheduler.for_model(
        model,
        eos_token_ids=[39],
        pad_token_id=0,
        max_running=max_running,
        kv_cache_bytes=4 << 20,
        page_size=4,
        true_on_policy=True,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_engine_logprobs_equal_the_trainers_whatever_the_batch(family, dtype):
    """Sampled together (continuous batching, prompts of 1 to 17 tokens) or one request at a
    time, the engine's log-probs are the trainer's for the same tokens, bitwise."""
    model = tiny(family, dtype)
    for max_running in (8, 1):
        check_logprobs_equal_the_trainers(model, engine(model, max_running))


def test_stale_nan_in_the_kv_pool_does_not_leak():
    """Slots a row has not written (stale pages, the page table's padding) hold NaN here: the
    engine never lets them into a weighted sum, so the log-probs are still the trainer's."""
    model = tiny("qwen3", torch.float32)
    scheduler = engine(model, 8)
    for layer in range(scheduler.pool.num_layers):
        for store in scheduler.pool.flat(layer):
            store.fill_(float("nan"))
    check_logprobs_equal_the_trainers(model, scheduler)


def check_logprobs_equal_the_trainers(model: torch.nn.Module, scheduler: Scheduler) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.8, ignore_eos=True)
    outputs = scheduler.generate([GenerateRequest(list(p), params) for p in PROMPTS])
    items = [
        TrainItem(p + o.output_ids, len(o.output_ids), [1] * 12, o.output_token_logprobs, 0.0)
        for p, o in zip(PROMPTS, outputs, strict=True)
    ]
    micro = collate(items, 0, next(model.parameters()).device)
    with torch.no_grad():
        logprobs_B_T, _ = invariant_scores(model, micro, 0.8, 0)
    assert torch.equal(logprobs_B_T, micro.rollout_logprobs_B_T)


def records(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/grad_norm" in r]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["trainer.dtype=bfloat16"],
        ["model.tiny.family=qwen3-moe", "model.tiny.num_experts=4"],
        # max_staleness 0: every group trained was sampled by the version that trains on it
        [
            "mode=fully_async",
            "placement.mode=disaggregated",
            "placement.engines=processes",
            "rollout.max_staleness=0",
        ],
    ],
    ids=["sync_fp32", "sync_bf16", "sync_moe", "fully_async"],
)
def test_train_logprob_diff_is_exactly_zero(tmp_path: Path, overrides: list[str]):
    run_dir = tmp_path / "run"
    assert main(["train", *RUN, *overrides, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert len(rows) == 3
    for row in rows:
        assert row["train/train_rollout_logprob_abs_diff"] == 0.0
        assert row["train/grad_norm"] > 0  # the weights do change between steps


def test_normal_mode_differs(tmp_path: Path):
    """The contrast: without the mode, the engine's fused forward differs in the last bits."""
    run_dir = tmp_path / "run"
    args = [*RUN[:-1], "num_steps=2", "trainer.true_on_policy=false"]
    assert main(["train", *args, "--run-dir", str(run_dir)]) == 0
    assert all(r["train/train_rollout_logprob_abs_diff"] > 0 for r in records(run_dir))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.backend=megatron", "trainer.backend=megatron"),
        ("model.lora.rank=4", "model.lora"),
        ("rollout.return_routed_experts=true", "rollout.return_routed_experts"),
        ("model.tiny.family=mistral", "model.tiny.family=mistral"),
        ("placement.backend=ray", "placement.backend=ray"),
        ("trainer.device=cpu placement.engine_devices=[cuda:0]", "placement.engine_devices"),
    ],
)
def test_what_cannot_guarantee_it_is_refused(override: str, named: str):
    with pytest.raises(ConfigError, match="trainer.true_on_policy") as error:
        load_config(None, ["trainer.true_on_policy=true", *override.split()])
    assert named in str(error.value)
