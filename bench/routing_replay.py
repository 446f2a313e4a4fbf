"""Rollout routing replay (R3) on a tiny MoE: how often the trainer would route as the engine
did, and training stability with and without replay over the same run.

Two runs of `examples/moe.yaml` (a tiny Qwen3-MoE on the addition task, warm start off), the
same seed, prompts and steps (`--dtype bfloat16`, where the CPU or GPU has it, makes the
engine's and the trainer's kernels round apart, so more choices flip): one with
`loss.routing_replay` on,
one with it off (the engine still records its experts, so the trainer measures agreement).

    python bench/routing_replay.py --steps 20

Prints, per run, routing agreement (the share of the engine's (token, layer, expert) choices
the trainer makes itself; 1.0 = no flips), the train-rollout log-prob difference, grad norm
and train-rollout KL (mean and max over steps), the ratios replay / no replay, and writes
bench/results/routing_replay_cpu_<dtype>.json.
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

EXAMPLE = Path(__file__).parent.parent / "examples" / "moe.yaml"
KEYS = (
    "train/routing_agreement",
    "train/train_rollout_logprob_abs_diff",
    "train/train_rollout_logprob_abs_diff_no_replay",
    "train/grad_norm",
    "train/train_rollout_kl",
    "rollout/reward_mean",
)


def warm_start(steps: int) -> list[str]:
    """SFT steps before RL (a random tiny model never answers right, so RL alone sees reward 0
    and no gradient): `steps` of them, none of the dev checks that would stop it early."""
    if steps <= 0:
        return ["warm_start.enabled=false"]
    return [
        "warm_start.enabled=true",
        f"warm_start.max_steps={steps}",
        "warm_start.target_accuracy=1.0",
        f"warm_start.check_interval_steps={steps}",
        "warm_start.dev_data.max_prompts=16",
    ]


def run(replay: bool, args: argparse.Namespace, root: Path) -> dict[str, dict[str, float]]:
    overrides = [
        f"num_steps={args.steps}",
        f"num_threads={args.threads}",
        f"seed={args.seed}",
        "trainer.device=cpu",
        f"trainer.dtype={args.dtype}",
        f"loss.routing_replay={str(replay).lower()}",
        "rollout.return_routed_experts=true",
        *warm_start(args.warm_steps),
        "eval.interval_steps=0",
        "checkpoint.interval_steps=0",
        f"rollout.prompts_per_step={args.prompts}",
    ]
    run_dir = root / ("replay" if replay else "no_replay")
    train(load_config(EXAMPLE, overrides), run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/grad_norm" in r]
    summary = {}
    for key in KEYS:
        values = [r[key] for r in rows if key in r]
        if values:
            summary[key] = {"mean": statistics.fmean(values), "max": max(values)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="RL steps per run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (16 samples)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-steps", type=int, default=200, help="SFT steps before RL")
    parser.add_argument("--dtype", default="float32", help="trainer.dtype: float32 | bfloat16")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        modes = (("no_replay", False), ("replay", True))
        runs = {name: run(replay, args, Path(tmp)) for name, replay in modes}
    ratios = {
        key: runs["replay"][key]["mean"] / runs["no_replay"][key]["mean"]
        for key in ("train/grad_norm", "train/train_rollout_kl")
        if runs["no_replay"].get(key, {}).get("mean")
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {
        "bench": "routing_replay",
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "commit": commit.stdout.strip(),
        "args": vars(args),
        "runs": runs,
        "ratio_replay_over_no_replay": ratios,
    }
    for name, summary in runs.items():
        print(name, {k: round(v["mean"], 6) for k, v in summary.items()})
    print("replay / no replay (means):", {k: round(v, 4) for k, v in ratios.items()})
    out = Path(args.out) / f"routing_replay_cpu_{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
