"""Training throughput lost to evaluation in fully async mode: each `eval.mode` vs none.

Every run is `examples/async_eval.yaml` (the quick start's addition task, fully async, one
`verst serve` engine process generating for the rollout) with the same steps, seed and batch;
only the evaluation differs:

- `none`: `eval.interval_steps=0`;
- `shared`: every `--interval` steps on the rollout engine (the worker pauses meanwhile);
- `fleet`: every `--interval` steps on an engine process of its own, from a snapshot;
- `external`: every `--interval` steps, `evaluate_checkpoint` below (this file's own function:
  the snapshot loaded with transformers and scored on the eval set by the embedded engine, in
  the function's own process).

The snapshot modes' evaluation processes run `eval.nice` steps below normal CPU priority:
`--eval-nice 0 10` runs each snapshot mode once per value in every repeat (labelled
`fleet@nice0`, `fleet@nice10`, ...); unset, at the config's default.

Runs alternate `--repeats` times, in order (none, shared, fleet, external) and then in reverse
(external, fleet, shared, none), so a change of the machine's load touches every mode alike
and a steady drift cancels over two repeats. The steady part is steps `--skip`+1 .. N-1 (the first
steps start up; the last one always evaluates and checkpoints). Per run it reports:

- `perf_samples_per_s`: trained samples over the sum of every `perf/<phase>_time_s` of those
  steps (wait, reward, train, sync, eval, checkpoint): the trainer's throughput by its timers;
- `wall_samples_per_s`: the same samples over the wall time between the records of steps
  `--skip` and N-1, stamped as they are written (includes logging);
- `cpu_s_per_step`: CPU seconds of the whole process tree (trainer, rollout engine, eval
  engine) over that window, per step: the work each mode adds, less sensitive to other load
  on the machine than wall time is;
- every evaluation point's `eval/lag_steps` and `eval/duration_s`, and whether it was valid
  (no `eval/skipped_*`, and for the engine modes every sample of the step's version alone).

Lost throughput per mode = 1 - (its median perf_samples_per_s) / (the median of `none`), and
the median over repeats of 1 - (a run's) / (the `none` run of the same repeat), paired; and
`trainer_blocked_pct`, the share of the trainer's time inside the eval phase (the shared
evaluation itself; a snapshot mode's export, and its wait for room when `eval.max_in_flight`
points are pending), which other load on the machine moves less.

    python bench/async_eval.py                      # CPU, 3 repeats of each mode
    python bench/async_eval.py --repeats 3 --steps 30
    python bench/async_eval.py --modes none fleet external --eval-nice 0 10 --repeats 4

Writes bench/results/async_eval_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from verst.config import load_config
from verst.eval.offline import evaluate_checkpoint_dir
from verst.loop import train
from verst.plugins import EvalRequest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "async_eval.yaml"
MODES = ("none", "shared", "fleet", "external")
# the loop's phases (`verst.loop.rl_step`); `perf/sync_<part>_time_s` are parts of sync
PHASES = ("wait", "reward", "teacher", "advantages", "train", "sync", "eval", "checkpoint")


def eval_set(prompts: int) -> dict[str, Any]:
    data = {"task": "addition", "split": "test", "shuffle": False, "max_prompts": prompts}
    return {"name": "addition", "data": data, "max_new_tokens": 4, "reward": "exact_match"}


def evaluate_checkpoint(checkpoint_dir: str, request: EvalRequest) -> dict[str, float]:
    """The bench's external evaluation: the snapshot's weights on the request's sets, scored
    by verst's offline evaluator (what `verst eval` runs), greedy, on the CPU."""
    sets = json.dumps(request.sets)
    cfg = load_config(None, [f"eval.sets={sets}", "trainer.device=cpu", "eval.interval_steps=1"])
    metrics = evaluate_checkpoint_dir(Path(checkpoint_dir), cfg)
    return {k: v for k, v in metrics.items() if "weight_version" not in k}


def labels(args: argparse.Namespace) -> list[str]:
    """The runs of one repeat, in order: a snapshot mode once per `--eval-nice` value."""
    out = []
    for mode in args.modes:
        snapshot = mode in ("fleet", "external")
        out += (
            [f"{mode}@nice{n}" for n in args.eval_nice] if snapshot and args.eval_nice else [mode]
        )
    return out


def overrides(label: str, args: argparse.Namespace) -> list[str]:
    mode, _, nice = label.partition("@nice")
    common = [
        f"num_steps={args.steps}",
        f"seed={args.seed}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n_samples_per_prompt={args.n}",
        "warm_start.enabled=false",
        "checkpoint.interval_steps=0",
        f"eval.sets=[{json.dumps(eval_set(args.eval_prompts))}]",
    ]
    if nice:
        common.append(f"eval.nice={nice}")
    if mode == "none":
        return [*common, "eval.interval_steps=0", "eval.mode=shared"]
    common.append(f"eval.interval_steps={args.interval}")
    if mode == "shared":
        return [*common, "eval.mode=shared"]
    if mode == "fleet":
        return [*common, "eval.mode=fleet", "eval.engine_threads=1"]
    return [*common, "eval.mode=external", "eval.function=async_eval:evaluate_checkpoint"]


def tree_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of `proc` and every live descendant."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class Stamper(threading.Thread):
    """Stamps each step record of `metrics.jsonl` with the wall clock and tree CPU seconds
    when it appears (polled every 50 ms)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.stamps: dict[int, tuple[float, float]] = {}
        self.halt = threading.Event()
        self.proc = psutil.Process()

    def run(self) -> None:
        offset = 0
        while not self.halt.wait(0.05):
            if not self.path.is_file():
                continue
            with self.path.open() as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offset += len(complete.encode())
            for line in complete.splitlines():
                row = json.loads(line)
                if "record" not in row:
                    self.stamps[row["step"]] = (time.monotonic(), tree_cpu_s(self.proc))


def point_valid(row: dict[str, Any], mode: str, versions: dict[int, float]) -> bool:
    if any(k.startswith("eval/skipped_") for k in row):
        return False
    if mode == "external":
        return "eval/addition/accuracy" in row or "eval/accuracy" in row
    mixed = row.get("eval/mixed_version_ratio", row.get("eval/addition/mixed_version_ratio"))
    mean = row.get("eval/weight_version/mean", row.get("eval/addition/weight_version/mean"))
    return mixed == 0 and mean == versions[row["step"]]


def summarise(mode: str, run_dir: Path, stamps: dict, args: argparse.Namespace) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "record" not in r}
    versions = {s: r["weight_version"] for s, r in steps.items()}
    window = [steps[s] for s in range(args.skip + 1, args.steps)]
    samples = len(window) * args.prompts * args.n
    perf_s = sum(r.get(f"perf/{phase}_time_s", 0.0) for r in window for phase in PHASES)
    (t0, c0), (t1, c1) = stamps[args.skip], stamps[args.steps - 1]
    if mode == "shared":
        points = [r for r in steps.values() if any(k.startswith("eval/") for k in r)]
    else:
        points = [r for r in rows if r.get("record") == "eval"]
    return {
        "perf_samples_per_s": samples / perf_s,
        "wall_samples_per_s": samples / (t1 - t0),
        "cpu_s_per_step": (c1 - c0) / len(window),
        "perf_eval_time_s_mean": statistics.fmean(r.get("perf/eval_time_s", 0.0) for r in window),
        "measured_steps": len(window),
        "eval_points": [
            {
                "step": r["step"],
                "valid": point_valid(r, mode, versions),
                "lag_steps": r.get("eval/lag_steps"),
                "duration_s": r.get("eval/duration_s"),
                "export_time_s": r.get("eval/export_time_s"),
            }
            for r in points
        ],
    }


def run_one(label: str, args: argparse.Namespace, run_dir: Path) -> dict:
    cfg = load_config(EXAMPLE, overrides(label, args))
    stamper = Stamper(run_dir / "metrics.jsonl")
    stamper.start()
    started = time.monotonic()
    try:
        train(cfg, run_dir)
    finally:
        stamper.halt.set()
        stamper.join()
    result = summarise(label.partition("@")[0], run_dir, stamper.stamps, args)
    result["wall_s_with_startup"] = time.monotonic() - started
    return result


def spread(values: list[float]) -> dict[str, float]:
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "spread_pct": 100 * (max(values) - min(values)) / med,
    }


def distribution(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    return {
        "n": len(values),
        "min": values[0],
        "median": statistics.median(values),
        "max": values[-1],
        "mean": statistics.fmean(values),
    }


def mode_row(results: list[dict], base: list[dict], samples_per_step: int) -> dict[str, Any]:
    """One mode's figures against `base` (the `none` runs, in the same alternation order)."""
    keys = ("perf_samples_per_s", "wall_samples_per_s", "cpu_s_per_step")
    row: dict[str, Any] = {key: spread([r[key] for r in results]) for key in keys}
    medians = {key: statistics.median(r[key] for r in base) for key in keys}
    row["lost_pct_perf"] = 100 * (1 - row["perf_samples_per_s"]["median"] / medians[keys[0]])
    row["lost_pct_wall"] = 100 * (1 - row["wall_samples_per_s"]["median"] / medians[keys[1]])
    row["extra_cpu_pct"] = 100 * (row["cpu_s_per_step"]["median"] / medians[keys[2]] - 1)
    # each run against the `none` run of its own repeat, minutes apart: load drifts less
    paired = [100 * (1 - r[keys[0]] / b[keys[0]]) for r, b in zip(results, base, strict=True)]
    row["lost_pct_paired"] = {
        "per_repeat": paired,
        "median": statistics.median(paired),
        "mean": statistics.fmean(paired),
    }
    # the share of the trainer's time spent inside the eval phase (blocked by evaluation)
    blocked = [100 * r["perf_eval_time_s_mean"] * r[keys[0]] / samples_per_step for r in results]
    row["trainer_blocked_pct"] = spread(blocked) if any(blocked) else {"median": 0.0}
    points = [p for r in results for p in r["eval_points"]]
    row["eval_points"] = len(points)
    row["eval_points_valid"] = sum(p["valid"] for p in points)
    row["lag_steps"] = distribution([p["lag_steps"] for p in points if p["lag_steps"] is not None])
    row["duration_s"] = distribution([p["duration_s"] for p in points if p["duration_s"]])
    return row


def report(runs: dict[str, list[dict]], samples_per_step: int) -> dict[str, Any]:
    table = {}
    for mode, results in runs.items():
        row = table[mode] = mode_row(results, runs["none"], samples_per_step)
        print(
            f"{mode:>9}: {row['perf_samples_per_s']['median']:.1f} samples/s "
            f"(spread {row['perf_samples_per_s']['spread_pct']:.0f}%), lost "
            f"{row['lost_pct_perf']:.1f}% of medians, {row['lost_pct_paired']['median']:.1f}% "
            f"paired, {row['lost_pct_wall']:.1f}% by wall; trainer blocked "
            f"{row['trainer_blocked_pct']['median']:.1f}%; cpu/step "
            f"{row['cpu_s_per_step']['median']:.2f}s; points valid "
            f"{row['eval_points_valid']}/{row['eval_points']}; lag {row['lag_steps']}",
            flush=True,
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-nice", type=int, nargs="*", default=[], help="eval.nice values; unset = default"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/async_eval_cpu.json")
    parser.add_argument(
        "--resummarise", action="store_true", help="recompute --out's summary from its runs"
    )
    args = parser.parse_args()
    if args.resummarise:
        record = json.loads(args.out.read_text())
        config = record["config"]
        record["summary"] = report(record["runs"], config["prompts"] * config["n"])
        args.out.write_text(json.dumps(record, indent=2))
        return

    runs: dict[str, list[dict]] = {label: [] for label in labels(args)}
    load: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            # odd repeats run in reverse order: a load that drifts one way over a repeat then
            # favours the later modes in one repeat and the earlier ones in the next
            order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
            for mode in order:
                load.append(os.getloadavg()[0])
                result = run_one(mode, args, Path(tmp) / f"{mode}_{repeat}")
                result["load_average_1m_at_start"] = load[-1]
                runs[mode].append(result)
                print(
                    f"[{repeat}] {mode}: {result['perf_samples_per_s']:.1f} samples/s "
                    f"(wall {result['wall_samples_per_s']:.1f}), load {load[-1]:.2f}",
                    flush=True,
                )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    record = {
        "benchmark": "async_eval",
        "device": platform.processor() or "cpu",
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "commit": commit,
        "config": vars(args) | {"out": str(args.out), "base": str(EXAMPLE.relative_to(ROOT))},
        "load_average_1m_at_run_starts": load,
        "summary": report(runs, args.prompts * args.n) if "none" in runs else None,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
