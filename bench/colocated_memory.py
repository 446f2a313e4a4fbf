"""Engine and trainer on one GPU with a model whose training state alone nearly fills it.

Runs `verst train examples/colocated_8b.yaml` (a Qwen3-8B-shaped random model, 6.9B
parameters) in a child process per variant and reads its metrics: each phase's peak of
allocated GPU memory (`perf/<phase>_peak_memory_gb`), the step's time and its phases, the
bytes the engine released and the optimizer state offloaded. Variants:

- `colocated`: as the recipe ships (placement.sleep_engines, trainer.offload=optimizer,
  trainer.gradient_checkpointing);
- `plain`: the same run with all three off, the baseline the GPU's memory is the limit of;
- `no-offload`, `no-sleep`: one of the two memory levers off.

    python bench/colocated_memory.py                              # every variant
    python bench/colocated_memory.py --variants colocated plain
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {
    "colocated": [],
    "plain": [
        "placement.sleep_engines=false",
        "trainer.offload=none",
        "trainer.gradient_checkpointing=false",
    ],
    "no-offload": ["trainer.offload=none"],
    "no-sleep": ["placement.sleep_engines=false"],
}
PHASES = ("rollout", "train", "sync")


def run_variant(name: str, config: Path, overrides: list[str], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "verst", "train", str(config), *VARIANTS[name]]
        command += [*overrides, "--run-dir", str(run_dir)]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            code, err = done.returncode, done.stderr
        except subprocess.TimeoutExpired as expired:
            code, err = "timeout", (expired.stderr or b"").decode(errors="replace")
        wall_s = time.perf_counter() - started
        metrics = run_dir / "metrics.jsonl"
        rows = (
            [json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.exists()
            else []
        )
    steps = [row for row in rows if row.get("step", 0) >= 1 and "perf/step_time_s" in row]
    result = {"variant": name, "overrides": VARIANTS[name] + overrides, "exit": code}
    result |= {"wall_s": round(wall_s, 1), "steps_completed": len(steps)}
    if code != 0:
        result["error"] = _last_error(err)
    if steps:
        result |= _summary(steps)
    return result


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    return (errors or lines or ["(no output)"])[-1][:400]


def _summary(steps: list[dict]) -> dict:
    """Peaks over the run's steps; times as medians over its steps after the first."""
    timed = steps[1:] or steps
    summary = {
        f"{phase}_peak_memory_gb": round(
            max(s.get(f"perf/{phase}_peak_memory_gb", 0) for s in steps), 2
        )
        for phase in PHASES
    }
    for key in ("step", *PHASES):
        summary[f"{key}_time_s"] = round(
            statistics.median(s[f"perf/{key}_time_s"] for s in timed), 2
        )
    for key in ("engine_released_bytes", "offloaded_bytes"):
        values = [s[f"perf/{key}"] for s in steps if f"perf/{key}" in s]
        if values:
            summary[key.replace("bytes", "gb")] = round(max(values) / 1e9, 2)
    summary["reward_mean"] = [round(s["rollout/reward_mean"], 3) for s in steps]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "colocated_8b.yaml")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per variant")
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench/results/colocated_memory_h200.json"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every variant")
    args = parser.parse_args()
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    result = {"config": str(args.config.relative_to(REPO)), "gpu": torch.cuda.get_device_name(0)}
    result |= {"gpu_memory_gb": round(total_gb, 1), "torch": torch.__version__, "variants": []}
    print(f"{result['gpu']}: {total_gb:.1f} GB")
    for name in args.variants:
        row = run_variant(name, args.config, args.overrides, args.timeout_s)
        result["variants"].append(row)
        peaks = " ".join(f"{p} {row.get(f'{p}_peak_memory_gb', '-')} GB" for p in PHASES)
        status = "ok" if row["exit"] == 0 else f"failed: {row.get('error')}"
        print(
            f"{name:10} | {row['steps_completed']} steps | peak {peaks} | step "
            f"{row.get('step_time_s', '-')} s | {status}"
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
