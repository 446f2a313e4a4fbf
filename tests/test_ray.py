"""`placement.backend: ray`: bundles, the checks that refuse what a cluster cannot place, and
one run through the public CLI that joins a two-node cluster started with `ray start` through
`$RAY_ADDRESS` (engine and trainer on different nodes, fully async) and survives its engine
and then its trainer rank killed (and one whose address has no cluster)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.faults import TrainProcess, complete_records
from tests.ray_nodes import RayNodes
from verst import exitcodes
from verst.cli import main
from verst.config import ConfigError, load_config
from verst.data.source import load_rows
from verst.fleet.launcher import free_port
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
    halves = cfg.model_copy(update={"ray_trainer_gpus": 0.5, "ray_engine_gpus": 0.5})
    assert [b["GPU"] for b in bundles(halves, cluster_gpus=1)] == [0.5] * 4  # two per GPU
    with pytest.raises(ValueError, match="placement.ray_engine_gpus=1.5: Ray places a fraction"):
        PlacementConfig(backend="ray", ray_engine_gpus=1.5)


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


def test_a_ray_address_with_no_cluster_fails_at_once_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray")
    nothing = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", nothing)
    began = time.monotonic()
    code = main(["train", EXAMPLE, "--run-dir", str(tmp_path / "run")])
    assert time.monotonic() - began < 30  # ray.init alone retries such an address for minutes
    assert code == exitcodes.BAD_INPUT
    assert f"$RAY_ADDRESS={nothing}: no Ray cluster answers there" in capsys.readouterr().err
    monkeypatch.delenv("RAY_ADDRESS")
    unreachable = f"placement.ray_address={nothing}"
    code = main(["train", EXAMPLE, unreachable, "--run-dir", str(tmp_path / "run2")])
    assert code == exitcodes.BAD_INPUT
    assert f"{unreachable}: no Ray cluster answers" in capsys.readouterr().err
    code = main(["train", EXAMPLE, "placement.ray_address=head", "--run-dir", str(tmp_path / "r3")])
    assert code == exitcodes.BAD_INPUT
    assert "a Ray cluster address is HOST:PORT" in capsys.readouterr().err


TINY = [
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 64, max_position_embeddings: 64}",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "warm_start.enabled=false",
    "eval.interval_steps=0",
]


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
def test_ray_fully_async_on_a_ray_start_cluster_survives_an_engine_and_a_trainer_rank_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's run joins a two-node cluster of `ray start` nodes through $RAY_ADDRESS
    (its trainer rank and engine on that cluster's nodes, by their resources); its engine and
    then its trainer rank are killed; it ends with every step once and the ledger exact, and
    the cluster outlives it."""
    pytest.importorskip("ray")
    cluster = RayNodes()
    try:
        cluster.start([(1, {"verst_trainer": 1}), (1, {"verst_engine": 1})])
        by_role = {
            next(k for k in n["resources"] if k.startswith("verst_")): n["id"]
            for n in cluster.nodes()
        }
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        run_dir = tmp_path / "run"
        _kill_an_engine_then_a_trainer_rank(run_dir)
        assert (
            f"Ray cluster at {cluster.address} ready" in (run_dir.with_suffix(".log")).read_text()
        )
        placements = [json.loads(line) for line in (run_dir / "placement.jsonl").open()]
        for placed in placements:  # the first run's and the restarted one's
            assert placed["trainer_nodes"] == [by_role["verst_trainer"]], (placed, by_role)
            assert placed["engine_nodes"] == [by_role["verst_engine"]], (placed, by_role)
        assert len(cluster.nodes()) == 2  # a cluster the run joined stays up
    finally:
        cluster.stop()


def _kill_an_engine_then_a_trainer_rank(run_dir: Path) -> None:
    overrides = [
        "num_steps=16",
        *TINY,
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
