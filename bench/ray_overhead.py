"""The Ray placement layer's overhead: the same fully asynchronous run under
`placement.backend: local` and `placement.backend: ray`, on one machine, and Ray's start-up.

Both runs go through the public CLI (`verst train`) with the same model, prompts, seed, batch
and placement (one engine process, disaggregated, broadcast weight sync); only the backend
differs. Under `ray` the run starts its own local Ray cluster (`--nodes` nodes of one CPU each,
the trainer's bundle on the first and the engine's on the last, as `examples/ray_local.yaml`),
so its trainer rank and engine are Ray actors on different Ray nodes of this machine. The step
time compared is the median `perf/step_time_s` after the first `--skip` steps; the goal is a
ratio ray / local <= 1.05. Ray's start-up (a cluster of the same nodes, joined and ready to
place bundles) is timed on its own, `--startups` times.

    python bench/ray_overhead.py                   # CPU, writes bench/results/ray_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = (
    "{hidden_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1, intermediate_size: 256, "
    "max_position_embeddings: 64}"
)


def ray_nodes(nodes: int) -> list[str]:
    layout = ["{num_cpus: 1, resources: {verst_trainer: 1}}"]
    layout += ["{num_cpus: 1}"] * (nodes - 2) + ["{num_cpus: 1, resources: {verst_engine: 1}}"]
    return [
        "placement.backend=ray",
        f"placement.ray_local_nodes=[{', '.join(layout)}]",
        "placement.ray_trainer_resources={verst_trainer: 1}",
        "placement.ray_engine_resources={verst_engine: 1}",
    ]


def run(backend: str, args: argparse.Namespace, run_dir: Path) -> dict[str, float]:
    overrides = [
        "mode=fully_async",
        f"num_steps={args.steps}",
        "num_threads=1",
        f"model.tiny={TINY}",
        "data={task: addition, split: train}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n_samples_per_prompt={args.n}",
        "rollout.max_new_tokens=4",
        "rollout.max_staleness=2",
        "placement.engines=processes",
        "placement.mode=disaggregated",
        "placement.engine_threads=1",
        "sync.transport=broadcast",
        "eval.interval_steps=0",
        "checkpoint.interval_steps=0",
        *(ray_nodes(args.nodes) if backend == "ray" else []),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    began = time.monotonic()
    cmd = [sys.executable, "-m", "verst", "train", *overrides, "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{backend} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    wall_s = time.monotonic() - began
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = [r["perf/step_time_s"] for r in rows if r["step"] > args.skip]
    return {
        "step_time_median_s": statistics.median(steps),
        "step_time_mean_s": statistics.fmean(steps),
        "steps_timed": len(steps),
        "wall_s": wall_s,
    }


def startup_s(nodes: int) -> float:
    """Seconds from nothing to a joined local cluster of `nodes` nodes, ready to place."""
    from verst.config import load_config
    from verst.fleet.ray_cluster import connect

    cfg = load_config(None, ray_nodes(nodes)).placement  # no engine bundles: embedded
    cluster = connect(cfg)
    cluster.shutdown()
    return cluster.start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--startups", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/ray_overhead_cpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        local = run("local", args, Path(tmp) / "local")
        ray = run("ray", args, Path(tmp) / "ray")
    print(f"local {local}\nray {ray}", flush=True)
    startups = [startup_s(args.nodes) for _ in range(args.startups)]
    ratio = ray["step_time_median_s"] / local["step_time_median_s"]
    result = {
        "local": local,
        "ray": ray,
        "step_time_ratio_ray_over_local": ratio,
        "goal_ratio": 1.05,
        "ray_startup_s": startups,
        "args": vars(args) | {"out": str(args.out)},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {platform.system()}",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
    }
    print(
        f"step time (median) local {local['step_time_median_s']:.3f} s, ray "
        f"{ray['step_time_median_s']:.3f} s: ray / local = {ratio:.3f} (goal <= 1.05); "
        f"Ray start-up {', '.join(f'{s:.1f}' for s in startups)} s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
