"""Serving-engine placements: config refusals, weights after each transport, end to end runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_loop import SMALL, records, torchrun_train
from verst import launch
from verst.cli import main
from verst.config import ConfigError, load_config
from verst.fleet.client import InProcessEngineClient
from verst.loop import train_items

pytest.importorskip("aiohttp")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mode=fully_async"], "needs placement.mode=disaggregated"),
        (["placement.mode=disaggregated"], "needs placement.engines=processes"),
        (["placement.engines=in_process", "sync.transport=broadcast"], "joins the trainer"),
        (["sync.transport=disk"], "needs serving engines"),
        (["placement.num_engines=2"], "num_engines > 1 needs"),
        (
            [
                "mode=fully_async",
                "placement.engines=processes",
                "placement.mode=disaggregated",
                "rollout.pause_mode=abort",
            ],
            "retract or in_place",
        ),
        (
            [
                "placement.engines=processes",
                "placement.mode=disaggregated",
                "sync.transport=colocated",
            ],
            "needs placement.mode=colocated",
        ),
    ],
)
def test_impossible_combinations_fail_at_config_time(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_auto_transport_follows_the_engines() -> None:
    cfg = load_config(None, ["placement.engines=processes"])
    assert cfg.sync.resolve(cfg.placement) == "colocated"
    cfg = load_config(None, ["placement.engines=processes", "placement.mode=disaggregated"])
    assert cfg.sync.resolve(cfg.placement) == "broadcast"
    cfg = load_config(None, ["placement.engines=in_process"])
    assert cfg.sync.resolve(cfg.placement) == "colocated"


def _one_step_then_push(run: launch.Run) -> None:
    groups, _ = run.rollout.groups(run.engine.weight_version)
    run.rewards.score_groups(groups)
    run.policy.trainer.step(train_items(groups, run.cfg.loss), step=1)
    run.sync.push(run.engine.weight_version + 1)


@pytest.mark.parametrize("transport", ["colocated", "disk"])
def test_in_process_engines_hold_the_trainers_weights_bit_for_bit(
    tmp_path: Path, transport: str
) -> None:
    cfg = load_config(
        None,
        [
            *SMALL,
            "warm_start.enabled=false",
            "placement.engines=in_process",
            "placement.num_engines=2",
            f"sync.transport={transport}",
        ],
    )
    run = launch.build(cfg, tmp_path)
    try:
        _one_step_then_push(run)
        trainer = {n: p.detach() for n, p in run.policy.trainer.named_local_parameters()}
        assert run.fleet is not None
        for client in run.fleet.clients:
            assert isinstance(client, InProcessEngineClient)
            engine = dict(client.serving.scheduler.model.named_parameters())
            assert engine.keys() == trainer.keys()
            for name, tensor in trainer.items():
                assert torch.equal(engine[name].detach(), tensor), name
            assert client.serving.weight_version == str(run.engine.weight_version)
    finally:
        run.close()


def test_in_process_engines_train_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = ["placement.engines=in_process", "placement.num_engines=2"]
    assert main(["train", *SMALL, *overrides, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert [r["weight_version"] for r in rows] == [3, 4, 5, 6, 7]
    for row in rows[1:]:
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-5
        assert row["sync/resent_engines"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["placement.num_engines=2", "sync.transport=broadcast"],
        ["sync.transport=colocated"],  # an engine process on the trainer's device: shared memory
    ],
    ids=["broadcast", "shared_memory"],
)
def test_engine_processes_train_end_to_end(tmp_path: Path, overrides: list[str]) -> None:
    run_dir = tmp_path / "run"
    processes = ["placement.engines=processes", "placement.engine_threads=1", "sync.bucket_mb=1"]
    assert main(["train", *SMALL, *processes, *overrides, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows[1:]:
        # the engines' log-probs are the trainer's: the transport delivered its weights
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-5
        assert row["sync/resent_engines"] == 0
        # each engine process's GET /metrics, sampled into the step's record
        assert row["engine/sampled_engines"] == row["fault/serving_engines"]
        assert row["engine/weight_version"] == row["weight_version"]
        assert row["engine/requests"] > 0 and row["engine/e2e_latency_mean_s"] > 0


def test_pause_mode_defaults_to_in_place_only_when_fully_async() -> None:
    assert load_config(None, []).pause_mode == "retract"
    disaggregated = ["placement.engines=processes", "placement.mode=disaggregated"]
    assert load_config(None, ["mode=fully_async", *disaggregated]).pause_mode == "in_place"
    chosen = ["mode=fully_async", *disaggregated, "rollout.pause_mode=retract"]
    assert load_config(None, chosen).pause_mode == "retract"


def test_agents_refuse_the_abort_pause() -> None:
    overrides = [
        "placement.engines=in_process",
        "rollout.agent_function=examples.calculator_agent:run_agent",
        "rollout.pause_mode=abort",
    ]
    with pytest.raises(ConfigError, match="cut agents' turns short"):
        load_config(None, overrides)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["placement.engines=in_process", "placement.num_engines=2"],
        ["placement.engines=processes", "placement.engine_threads=1", "sync.transport=broadcast"],
        [
            "mode=fully_async",
            "placement.engines=processes",
            "placement.mode=disaggregated",
            "placement.engine_threads=1",
        ],
    ],
    ids=["in_process", "processes_broadcast", "fully_async"],
)
def test_two_trainer_ranks_share_rank_zeros_engines(tmp_path: Path, overrides: list[str]) -> None:
    """torchrun: FSDP2 over two ranks; rank 0 holds the engines and serves both ranks' prompts;
    weights reach the engines gathered tensor by tensor."""
    run_dir = tmp_path / "run"
    torchrun_train([*SMALL, *overrides, "num_steps=2"], run_dir)
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["rollout/num_samples"] == 16  # both ranks' samples, counted once
    for row in rows[1:]:
        assert row["sync/resent_engines"] == 0
        if "mode=fully_async" in overrides:
            assert row["buffer/staleness_max"] <= 4  # the default max_staleness
        else:  # the engines' log-probs are the trainer's: the gathered weights arrived
            assert row["train/train_rollout_logprob_abs_diff"] < 1e-4


@pytest.mark.slow
def test_a_dead_engine_process_is_routed_around(tmp_path: Path) -> None:
    """Without fault tolerance a dead engine is only routed around (restarts: in
    tests/test_fault_tolerance.py)."""
    cfg = load_config(
        None,
        [
            *SMALL,
            "warm_start.enabled=false",
            "placement.engines=processes",
            "placement.num_engines=2",
            "placement.engine_threads=1",
            "sync.transport=disk",
            "fault_tolerance.enabled=false",
        ],
    )
    run = launch.build(cfg, tmp_path)
    try:
        assert run.fleet is not None
        _one_step_then_push(run)
        run.fleet.processes[1].stop()  # the engine dies between two steps
        groups, _ = run.rollout.groups(run.engine.weight_version)
        run.rewards.score_groups(groups)
        assert all(s.response_length > 0 for g in groups for s in g)
        assert len(run.fleet.router.live_engines) == 1
        run.policy.trainer.step(train_items(groups, cfg.loss), step=2)
        metrics = run.sync.push(run.engine.weight_version + 1)
        assert metrics["sync/live_engines"] == 1 and metrics["sync/resent_engines"] == 0
    finally:
        run.close()
