"""True on-policy mode against the normal mode: the train-rollout log-prob difference (must be
exactly 0 with the mode on) and what the mode costs in engine tokens/s and trainer step time.

Two `verst train` runs of the quick-start config (addition task, the default tiny Qwen3 of
4 layers × 128 wide, embedded engine, sync mode) with the same seed and steps, eval and
checkpoints off, `loss.entropy_coef` on so the weights change every step even while every
reward is 0 (a random tiny model): one with `trainer.true_on_policy=false`, one with it true.

    python bench/true_on_policy.py --steps 8 --dtype float32
    python bench/true_on_policy.py --steps 8 --dtype bfloat16 --device cuda --prompts 32

Prints per run the mean (and max) `train/train_rollout_logprob_abs_diff`, the engine's
generation tokens/s (generated tokens over each step's wall time, training included; and
over the scheduler's busy time, `engine/busy_fraction` of it: the engine's own speed) and
`perf/train_time_s` (means over steps after the first, which pays
warm-up; medians over `--repeats` alternated pairs of runs, since a shared CPU's load moves
them), the slowdowns of true on-policy (the issue's goal: each <= 1.5), and writes
bench/results/true_on_policy_<device>_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from verst.config import load_config
from verst.loop import train

DIFF = "train/train_rollout_logprob_abs_diff"
TOK_S = "engine/generation_tokens_per_s"
BUSY = "engine/busy_fraction"  # of the step's wall time, the scheduler's working share
TRAIN_S = "perf/train_time_s"


def run(on: bool, args: argparse.Namespace, root: Path) -> dict[str, float]:
    overrides = [
        f"num_steps={args.steps}",
        f"num_threads={args.threads}",
        f"seed={args.seed}",
        f"trainer.device={args.device}",
        f"trainer.dtype={args.dtype}",
        f"trainer.true_on_policy={str(on).lower()}",
        f"model.tiny.family={args.family}",
        "trainer.lr=1e-3",
        "loss.entropy_coef=0.01",
        "warm_start.enabled=false",
        "eval.interval_steps=0",
        "checkpoint.interval_steps=0",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
    ]
    run_dir = root / f"{'true_on_policy' if on else 'normal'}_{len(list(root.iterdir()))}"
    train(load_config(None, overrides), run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/grad_norm" in r]
    later = rows[1:] or rows
    return {
        "logprob_abs_diff_mean": statistics.fmean(r[DIFF] for r in rows),
        "logprob_abs_diff_max": max(r[DIFF] for r in rows),
        "engine_tokens_per_s": statistics.fmean(r[TOK_S] for r in later),
        "engine_tokens_per_busy_s": statistics.fmean(r[TOK_S] / r[BUSY] for r in later),
        "train_time_s": statistics.fmean(r[TRAIN_S] for r in later),
        "response_len_mean": statistics.fmean(r["rollout/response_len_mean"] for r in rows),
        "steps": len(rows),
    }


def median_of(summaries: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (8 samples each)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs per mode")
    parser.add_argument("--dtype", default="float32", help="trainer.dtype: float32 | bfloat16")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="trainer.device")
    parser.add_argument("--family", default="qwen3", help="model.tiny.family (qwen3-moe too)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    repeats: dict[str, list[dict[str, float]]] = {"normal": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # alternated, so a shared machine's load hits both
            for name, on in (("normal", False), ("on", True)):
                repeats[name].append(run(on, args, Path(tmp)))
    normal, on = (median_of(repeats[name]) for name in ("normal", "on"))
    ratios = {
        "engine_slowdown": normal["engine_tokens_per_s"] / on["engine_tokens_per_s"],
        "engine_busy_slowdown": normal["engine_tokens_per_busy_s"] / on["engine_tokens_per_busy_s"],
        "train_step_slowdown": on["train_time_s"] / normal["train_time_s"],
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {
        "bench": "true_on_policy",
        "machine": torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{platform.machine()} CPU, {args.threads} threads",
        "torch": torch.__version__,
        "commit": commit.stdout.strip(),
        "args": vars(args),
        "runs": {"normal": normal, "true_on_policy": on},
        "repeats": {"normal": repeats["normal"], "true_on_policy": repeats["on"]},
        "ratios": ratios,
    }
    for name, summary in result["runs"].items():
        print(name, {k: round(v, 9) for k, v in summary.items()})
    print("slowdown of true on-policy (medians):", {k: round(v, 3) for k, v in ratios.items()})
    suffix = "" if args.family == "qwen3" else f"_{args.family}"
    out = Path(args.out) / f"true_on_policy_{args.device}_{args.dtype}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
