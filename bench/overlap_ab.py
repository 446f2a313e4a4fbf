"""Overlapped decode steps off vs on (`engine.overlap`), in one process, on one scheduler.

The model and workload of `engine_throughput.py`'s preset (`--preset h200`: Qwen2-0.5B-shaped,
bf16, 128-token prompts, 256 new tokens, sampling at temperature 1, EOS ignored). One
scheduler per batch size, warmed at the batch's shapes (decode graphs captured) untimed; then
its `overlap` switch alternates between the runs, `--rounds` times, each run on an empty prefix
cache. Prints tok/s and ms per scheduler step for each, and the ratio on / off from the best
round, and saves JSON. On the CPU it is a smoke check of the path (the overlap gains nothing
there: the CPU computes each step as it is launched).

    python bench/overlap_ab.py --preset h200 --out bench/results/overlap_ab_h200.json
    python bench/overlap_ab.py --preset host --batches 16 --new-tokens 16 --rounds 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import (  # noqa: E402
    PRESETS,
    batch_prompts,
    build_model,
    cold_generate,
    new_scheduler,
    timed,
    warm_scheduler,
)

from verst.engine.scheduler import Scheduler  # noqa: E402

VARIANTS = {"off": False, "on": True}


def run_once(scheduler: Scheduler, prompts: list[list[int]], new: int, overlap: bool) -> dict:
    """One timed run: tok/s and ms per scheduler step."""
    scheduler.overlap = overlap  # between runs nothing is pending: a plain switch
    steps_before = scheduler.stats.steps
    seconds = timed(lambda: cold_generate(scheduler, prompts, new))
    steps = scheduler.stats.steps - steps_before
    return {"tok_s": len(prompts) * new / seconds, "ms_per_step": 1000 * seconds / steps}


def run_batch(model, args, preset: dict, dtype: torch.dtype, device: str, batch: int) -> dict:
    new = args.new_tokens or preset["new_tokens"]
    prompts = batch_prompts(model, preset, batch)
    scheduler = new_scheduler(model, dtype, device, args.kv_budget_mb << 20)
    warm_scheduler(scheduler, prompts, batch)
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, overlap in VARIANTS.items():
            run = run_once(scheduler, prompts, new, overlap)
            runs[name].append(run)
            print(
                f"batch {batch:4d} overlap {name:3s} {run['tok_s']:10.1f} tok/s "
                f"{run['ms_per_step']:7.3f} ms/step",
                flush=True,
            )
    best = {name: max(r["tok_s"] for r in rounds) for name, rounds in runs.items()}
    fastest_step = {name: min(r["ms_per_step"] for r in rounds) for name, rounds in runs.items()}
    row = {
        "batch": batch,
        "new_tokens": new,
        "prompt_tokens": preset["prompt_tokens"],
        "runs": runs,
        **{f"{name}_tok_s": tok_s for name, tok_s in best.items()},
        **{f"{name}_ms_per_step": ms for name, ms in fastest_step.items()},
        "on_over_off": best["on"] / best["off"],
    }
    print(f"batch {batch:4d}: overlap on / off {row['on_over_off']:.3f}x", flush=True)
    return row


def main() -> None:
    args = parse_args()
    preset = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or preset["dtype"])
    model = build_model(preset["model"], dtype, device)
    rows = [
        run_batch(model, args, preset, dtype, device, batch)
        for batch in args.batches or preset["batches"]
    ]
    out = {
        "benchmark": "overlap_ab",
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "batches": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        print(f"saved {args.out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--batches", type=int, nargs="*", default=None)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: the preset's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-budget-mb", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args()


if __name__ == "__main__":
    main()
