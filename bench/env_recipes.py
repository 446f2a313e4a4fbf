"""Does an environment recipe learn on this machine, and at what cost? Runs `verst train RECIPE`
(with overrides) in a child process, samples the machine's load average while it runs, and
summarises the run's metrics.jsonl: the warm start, `rollout/reward_mean` of the first and last
steps, aborted trajectories, time per step, and the child's CPU time (user + system, bwrap
children included), from which the wall time on an idle machine can be estimated when the
machine is shared.

    python bench/env_recipes.py examples/terminal_agent.yaml --out bench/results/x.json
    python bench/env_recipes.py examples/math_env.yaml --window 20 -- num_threads=1

Each run is appended to the JSON file's "runs" list, with its command and commit; the run's own
output goes to RUN_DIR.log.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import mean


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    # the results written so far are not the code under test
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)bench/results"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return out.stdout.strip() + ("+dirty" if dirty else "")


def _sample_load(stop: threading.Event, loads: list[float], every_s: float = 5.0) -> None:
    while not stop.wait(every_s):
        loads.append(os.getloadavg()[0])


def run_recipe(argv: list[str], log: Path) -> tuple[float, float, list[float], int]:
    """Run `verst train ...` with its output in `log`; (wall s, child CPU s, 1-min load
    averages seen, exit code)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    loads: list[float] = [os.getloadavg()[0]]
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(stop, loads), daemon=True)
    sampler.start()
    started = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    stop.set()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, loads, code


def summarise(run_dir: Path, window: int) -> dict:
    """The run's learning and cost, from its metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    first = rows[0]
    steps = [r for r in rows if r.get("step", 0) > 0 and "rollout/reward_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in steps]
    head, tail = rewards[:window], rewards[-window:]
    aborted = [r.get("rollout/agent_aborted_ratio", 0.0) for r in steps]
    out = {
        "warm_start_steps": first.get("warm_start/steps"),
        "warm_start_dev_accuracy": first.get("warm_start/dev_accuracy"),
        "rl_steps": len(steps),
        "reward_mean_first": mean(head) if head else None,
        "reward_mean_last": mean(tail) if tail else None,
        "reward_rise": mean(tail) - mean(head) if head else None,
        "rewards": [round(x, 4) for x in rewards],
        "aborted_ratio_mean": mean(aborted) if aborted else None,
        "step_time_s_mean": mean(r["perf/step_time_s"] for r in steps) if steps else None,
        "rollout_time_s_mean": mean(r["perf/rollout_time_s"] for r in steps) if steps else None,
        "train_time_s_mean": mean(r["perf/train_time_s"] for r in steps) if steps else None,
    }
    for key in ("rollout/env_errors_mean", "eval/accuracy"):
        seen = [(r["step"], r[key]) for r in rows if key in r]
        if seen:
            out[key] = {"first": seen[0], "last": seen[-1]}
    return out


def main() -> int:
    # a SIGTERM (`timeout`, `kill`) exits through Python, so `subprocess.run` stops the child
    # run too instead of leaving it training on
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for verst train")
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    parser.add_argument("--out", type=Path, default=Path("bench/results/env_recipes_cpu.json"))
    parser.add_argument(
        "--summarise-only",
        action="store_true",
        help="record the metrics of --run-dir as they are (a run stopped early), running nothing",
    )
    args = parser.parse_args()
    run_dir = args.run_dir or Path("/tmp/verst-bench-env") / Path(args.recipe).stem
    argv = ["verst", "train", args.recipe, *args.overrides, "--run-dir", str(run_dir)]
    if args.summarise_only:
        wall, cpu, loads, code = None, None, [os.getloadavg()[0]], None
    else:
        wall, cpu, loads, code = run_recipe([*argv, "--overwrite"], run_dir.with_suffix(".log"))
    record = {
        "recipe": args.recipe,
        "command": " ".join(["python", *sys.argv]),
        "commit": _commit(),
        "exit_code": code,
        "machine": f"{os.cpu_count()} CPU cores, shared with other engineers",
        "load_average_1min": {"min": min(loads), "mean": mean(loads), "max": max(loads)},
        "wall_s": wall,
        "cpu_s": cpu,
        **summarise(run_dir, args.window),
    }
    old = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    old["runs"].append(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(old, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "rewards"}, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
