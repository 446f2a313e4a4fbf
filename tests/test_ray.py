"""`placement.backend: ray`: bundles, the checks that refuse what a cluster cannot place, and
one run through the public CLI on a local two-node Ray cluster (engine and trainer on different
nodes, fully async) whose engine and then trainer rank are killed."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

import pytest

from tests.faults import TrainProcess, complete_records
from verst.config import ConfigError, load_config
from verst.data.source import load_rows
from verst.fleet.placement import PlacementConfig
from verst.fleet.ray_cluster import bundles, check_resources
from verst.rollout.ledger import LEDGER_FILE, check_exactly_once

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "ray_local.yaml")


def test_bundles_per_rank_and_engine_cpu_and_gpu_clusters() -> None:
    cfg = PlacementConfig(
        backend="ray",
        engines="processes",
        mode="disaggregated",
        num_engines=2,
        trainer_ranks=2,
        ray_engine_resources={"verst_engine": 1},
    )
    trainer, engine = {"CPU": 1.0}, {"CPU": 1.0, "verst_engine": 1}
    assert bundles(cfg, cluster_gpus=0) == [trainer, trainer, engine, engine]
    gpu = bundles(cfg.model_copy(update={"ray_engine_gpus": 2}), cluster_gpus=8)
    assert gpu == [{"CPU": 1.0, "GPU": 1}] * 2 + [{"CPU": 1.0, "GPU": 2, "verst_engine": 1}] * 2


def test_bundles_the_cluster_cannot_hold_are_refused_naming_the_fields() -> None:
    cfg = PlacementConfig(
        backend="ray", engines="processes", num_engines=2, ray_engine_resources={"e": 1}
    )
    nodes = [{"CPU": 1.0, "e": 1.0}, {"CPU": 1.0}]
    with pytest.raises(ValueError, match="placement.trainer_ranks=1 and placement.num_engines=2"):
        check_resources(bundles(cfg, 0), nodes, cfg)  # 3 CPUs wanted, 2 offered
    embedded = cfg.model_copy(update={"engines": "embedded"})
    assert bundles(embedded, 0) == [{"CPU": 1.0}]  # the engine runs in trainer rank 0
    with pytest.raises(ValueError, match="placement.ray_engine_cpus / ray_engine_gpus"):
        check_resources(bundles(cfg, 0), [{"CPU": 4.0}], cfg)  # no node offers `e`
    check_resources(bundles(cfg, 0), [{"CPU": 3.0, "e": 2.0}], cfg)


def test_bad_backend_configs_fail_when_the_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="placement.trainer_ranks > 1 needs placement.backend"):
        load_config(None, ["placement.trainer_ranks=2"])
    with pytest.raises(ConfigError, match="sync.transport=colocated"):
        load_config(
            None,
            [
                "placement.backend=ray",
                "placement.engines=processes",
                "sync.transport=colocated",
                "placement.ray_engine_resources={verst_engine: 1}",
            ],
        )
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"placement.backend=ray needs Ray.*verst\[ray\]"):
        load_config(None, ["placement.backend=ray"])


def _pids(*words: str) -> list[int]:
    """Processes whose command line holds every one of `words`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if entry.name.isdigit() and all(w in argv for w in words):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_ray_fully_async_survives_an_engine_and_a_trainer_rank_killed(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    overrides = [
        "num_steps=16",
        "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
        "intermediate_size: 64, max_position_embeddings: 64}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "warm_start.enabled=false",
        "eval.interval_steps=0",
        "checkpoint.interval_steps=5",
        "fault_tolerance.interval_s=0.5",
        "fault_tolerance.timeout_s=5",
    ]
    run = TrainProcess([EXAMPLE, *overrides], run_dir, extra_args=["--max-restarts", "1"])
    run.start()
    run.wait_for_step(2, timeout_s=400)
    (engine,) = _pids("serve", str(run_dir / "engine_init"))  # its actor is on the other node
    os.kill(engine, signal.SIGKILL)
    run.wait_until(lambda row: row.get("fault/engine_restarts", 0) >= 1, "engine restart", 200)
    run.wait_for_step(7)
    rank = next(p for p in _pids("train", str(run_dir)) if p != run.pid)
    os.kill(rank, signal.SIGKILL)
    assert run.finish(timeout_s=600) == 0, run.output()
    cfg = load_config(EXAMPLE, overrides)
    rows = run.records()
    assert [r["step"] for r in rows] == list(range(cfg.num_steps + 1)), "every step logged once"
    report = check_exactly_once(run_dir / LEDGER_FILE, len(load_rows(cfg.data)))
    assert report.ok, report.summary()
    (restart,) = complete_records(run_dir / "restarts.jsonl")
    assert restart["resumed_from"] is not None  # resumed from step 5's checkpoint
    placements = [json.loads(line) for line in (run_dir / "placement.jsonl").open()]
    (trainer_node,), (engine_node,) = placements[0]["trainer_nodes"], placements[0]["engine_nodes"]
    assert trainer_node != engine_node, placements
