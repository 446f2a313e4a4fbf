"""Does the megatron backend learn like FSDP2? The quick-start recipe (warm start, then GRPO)
run once per `trainer.backend` from the same seed, in one invocation, side by side.

Each run is a `verst train` subprocess (the runs go concurrently, one thread each unless
overridden). Reported per backend: the warm start's steps and dev accuracy, the mean sampled
reward over the first and last tenth of the steps, greedy accuracy at each evaluation, the
mean train/rollout log-prob difference, and the wall time; then megatron's figures against
FSDP2's. The two runs sample from weights equal to fp32 round-off, so their rollouts part
after a few steps and the curves agree as two seeds of one recipe do, not token for token.

    python bench/backend_learning.py [--steps 100] [--seeds 0 1 2] [--out FILE.json]
    python bench/backend_learning.py --steps 100 trainer.device=cuda   # overrides pass through
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("fsdp2", "megatron")


def launch(backend: str, run_dir: Path, steps: int, overrides: list[str]) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "verst", "train", str(ROOT / "examples" / "quickstart.yaml"),
        f"trainer.backend={backend}", f"num_steps={steps}", "num_threads=1",
        f"eval.interval_steps={max(steps // 2, 1)}", "checkpoint.interval_steps=0",
        *overrides, "--run-dir", str(run_dir),
    ]  # fmt: skip
    log = open(run_dir.with_suffix(".log"), "w")
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    }
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def summarise(run_dir: Path, wall_s: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    tenth = max(len(steps) // 10, 1)

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    return {
        "warm_start_steps": rows[0].get("warm_start/steps"),
        "warm_start_dev_accuracy": rows[0].get("warm_start/dev_accuracy"),
        "reward_first_tenth": mean("rollout/reward_mean", steps[:tenth]),
        "reward_last_tenth": mean("rollout/reward_mean", steps[-tenth:]),
        "eval_accuracy": {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r},
        "logprob_abs_diff_mean": mean("train/train_rollout_logprob_abs_diff", steps),
        "wall_s": wall_s,
    }


def run_seed(seed: int, steps: int, overrides: list[str]) -> dict[str, dict]:
    """Both backends from `seed`, concurrently; each one's summary and its own wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        seeded = [f"seed={seed}", *overrides]
        runs = {b: launch(b, Path(tmp) / b, steps, seeded) for b in BACKENDS}
        results: dict[str, dict] = {}
        while len(results) < len(runs):
            for backend, process in runs.items():
                if backend in results or process.poll() is None:
                    continue
                if process.returncode != 0:
                    log = (Path(tmp) / f"{backend}.log").read_text()[-3000:]
                    raise SystemExit(f"{backend} run failed:\n{log}")
                results[backend] = summarise(Path(tmp) / backend, time.perf_counter() - start)
            time.sleep(1.0)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench/results/backend_learning_cpu.json"
    )
    args, overrides = parser.parse_known_args()
    by_seed = {}
    for seed in args.seeds:
        by_seed[seed] = results = run_seed(seed, args.steps, overrides)
        for backend, result in results.items():
            first, last = result["reward_first_tenth"], result["reward_last_tenth"]
            print(f"seed {seed} {backend:9s} warm start {result['warm_start_steps']} steps; "
                  f"reward {first:.3f} -> {last:.3f}; eval accuracy "
                  f"{result['eval_accuracy']}; {result['wall_s']:.0f} s")  # fmt: skip
    for backend in BACKENDS:
        gains = [
            r[backend]["reward_last_tenth"] - r[backend]["reward_first_tenth"]
            for r in by_seed.values()
        ]
        final = [list(r[backend]["eval_accuracy"].values())[-1] for r in by_seed.values()]
        print(f"{backend:9s} mean reward gain {sum(gains) / len(gains):+.3f}, "
              f"mean final eval accuracy {sum(final) / len(final):.3f}")  # fmt: skip
    report = {
        "recipe": "examples/quickstart.yaml", "steps": args.steps, "overrides": overrides,
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "load_average_at_end": os.getloadavg(), "results_by_seed": by_seed,
    }  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
