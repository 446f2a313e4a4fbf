"""Agents in `verst train`: the calculator example end to end through the CLI (a few steps of a
smaller model), and one rollout + train step on in-process serving engines with a scripted tool
agent, checking the samples the trainer gets (exact session tokens, loss mask 0 on the tool
turn, per-turn versions) and that aborted trajectories are left out of training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from tests.test_loop import records, torchrun_train  # noqa: E402
from verst import launch  # noqa: E402
from verst.cli import main  # noqa: E402
from verst.config import load_config  # noqa: E402
from verst.loop import only_scored, train_items  # noqa: E402
from verst.rollout.source import AgentRollout  # noqa: E402
from verst.types import Status  # noqa: E402

EXAMPLE = "examples/calculator_agent.yaml"
QUICK = [
    "num_steps=2",
    "num_threads=1",
    "trainer.device=cpu",
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 64, max_position_embeddings: 128}",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "warm_start.max_steps=2",
    "warm_start.batch_size=8",
    "warm_start.check_interval_steps=1",
    "warm_start.dev_data.max_prompts=4",
    "checkpoint.interval_steps=0",
]
TOOL_RESULT = "TOOL SAYS 1776"


async def scripted_agent(
    base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    """Two model calls with a tool result between them, whatever the model says; the first
    sample of each group raises instead after its first call."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(messages=messages, **request_kwargs)
        if metadata.get("fail"):
            raise RuntimeError("scripted failure")
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "tool", "content": TOOL_RESULT},
        ]
        await client.chat.completions.create(messages=messages, **request_kwargs)
    return {"correct": True}


def test_calculator_example_trains_through_the_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", EXAMPLE, *QUICK, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["warm_start/steps"] == 2
    for row in rows[1:]:
        assert row["rollout/agent_aborted_ratio"] == 0.0
        assert row["rollout/agent_turns_mean"] >= 1.0
        assert row["rollout/response_len_mean"] > 0
        assert row["rollout/num_samples"] == 8
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-4  # the engine's log-probs


def test_agent_rollout_feeds_the_trainer_exact_masked_samples(tmp_path: Path) -> None:
    cfg = load_config(
        EXAMPLE,
        [
            *QUICK,
            "warm_start.enabled=false",
            "rollout.agent_function=tests.test_agent_train:scripted_agent",
        ],
    )
    run = launch.build(cfg, tmp_path)
    try:
        run.policy.start_rl()
        run.sync.push(run.engine.weight_version + 1)
        rollout = run.rollout
        assert isinstance(rollout, AgentRollout)
        groups = rollout.prompts()
        for group in groups:
            group[0].metadata["fail"] = True
        rollout._play(groups)
        run.rewards.score_groups(groups)
        for group in groups:
            failed, *played = group
            assert failed.status is Status.ABORTED and failed.reward == 0.0
            assert "scripted failure" in failed.metadata["agent_error"]
            assert failed.response_length == 0 and failed.loss_mask == []
            for sample in played:
                assert sample.status is not Status.ABORTED, sample.metadata
                assert sample.metadata["num_turns"] == 2 and sample.metadata["correct"]
                assert sample.weight_versions == [run.engine.weight_version] * 2
                mask = sample.loss_mask
                assert 0 in mask and mask[0] == 1 and mask[-1] == 1
                written = [t for t, m in zip(sample.response_tokens, mask, strict=True) if not m]
                assert TOOL_RESULT in run.fleet.tokenizer.decode(written)
                assert sample.metadata["mismatch"] is not None
        trainable = only_scored(groups)
        assert all(s.status is not Status.ABORTED for g in trainable for s in g)
        assert sum(map(len, trainable)) == sum(map(len, groups)) - len(groups)
        metrics = run.policy.trainer.step(train_items(trainable, cfg.loss), step=1)
        assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-4
    finally:
        run.close()


@pytest.mark.slow
def test_calculator_example_fully_async_on_engine_processes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fully_async = [
        "mode=fully_async",
        "placement.engines=processes",
        "placement.mode=disaggregated",
        "placement.engine_threads=1",
        "rollout.pause_mode=retract",
    ]
    assert main(["train", EXAMPLE, *QUICK, *fully_async, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["rollout/num_samples"] == 8 and row["rollout/response_len_mean"] > 0
        assert "rollout/agent_turns_mean" in row and "buffer/queue_size" in row


@pytest.mark.slow
def test_calculator_example_on_two_trainer_ranks(tmp_path: Path) -> None:
    """torchrun: rank 0's fleet and session server play both ranks' samples."""
    run_dir = tmp_path / "run"
    torchrun_train([EXAMPLE, *QUICK], run_dir)
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["rollout/num_samples"] == 8 and "rollout/agent_turns_mean" in row


def test_multi_turn_sessions_carry_the_routed_experts_for_replay(tmp_path: Path) -> None:
    """A MoE policy with routing replay through the calculator agent: every session's sample
    carries the experts of all its positions (the engine's record through the session server),
    the trainer replays them, and the replayed log-probs match the engine's."""
    run_dir = tmp_path / "run"
    moe = [
        "model.tiny={family: qwen3-moe, hidden_size: 32, num_layers: 2, num_heads: 2, "
        "num_kv_heads: 1, intermediate_size: 64, max_position_embeddings: 128, num_experts: 4, "
        "experts_per_token: 2}",
        "loss.routing_replay=true",
    ]
    assert main(["train", EXAMPLE, *QUICK, *moe, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["rollout/agent_turns_mean"] >= 1.0
        assert row["rollout/agent_aborted_ratio"] == 0.0
        assert 0.0 < row["train/routing_agreement"] <= 1.0
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-4
