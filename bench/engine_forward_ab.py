"""The scheduler's forward paths A/B, in one process: HF's layers, the lean forward without
fused kernels, and the lean forward with them (C on the CPU, Triton on CUDA), with Q/K/V and
gate/up as separate GEMMs and as one each (`lean_kernels_apart` vs `lean_kernels`; the CPU
fuses them only where it packs bf16 weights).

The same model and prompts go through each variant, alternated `--rounds` times (the machine's
speed drifts; alternating spreads the drift over all of them). Each variant is warmed at the
workload's shapes first. It prints tokens/s per variant and batch, the best round's ratio to HF's
layers, and saves JSON.

    python bench/engine_forward_ab.py --preset cpu --dtype bfloat16
    python bench/engine_forward_ab.py --preset h200          # on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import PRESETS, batch_prompts, build_model, requests, timed  # noqa: E402

from verst.engine.kv_pool import KVPool  # noqa: E402
from verst.engine.scheduler import Scheduler  # noqa: E402

VARIANTS = {
    "hf_layers": dict(lean_forward=False, fused_kernels=False),
    "lean": dict(lean_forward=True, fused_kernels=False),
    "lean_kernels_apart": dict(lean_forward=True, fused_kernels=True),
    "lean_kernels": dict(lean_forward=True, fused_kernels=True),
}
# Q/K/V and gate/up as separate GEMMs (on CUDA the lean forward fuses each group into one)
APART = {"lean_kernels_apart"}


def scheduler_for(model, variant: str, budget_mb: int) -> Scheduler:
    param = next(model.parameters())
    pool = KVPool.from_budget(
        model.config,
        budget_bytes=budget_mb << 20,
        page_size=16,
        dtype=param.dtype,
        device=param.device,
    )
    scheduler = Scheduler(model, pool, eos_token_ids=[], pad_token_id=0, **VARIANTS[variant])
    if variant in APART:
        scheduler.runner.lean.separate_projections()
    return scheduler


def main() -> None:
    args = parse_args()
    preset = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or preset["dtype"])
    model = build_model(preset["model"], dtype, device)
    new = preset["new_tokens"]
    variants = args.variants
    results: dict[str, dict[int, list[float]]] = {v: {} for v in variants}
    for _ in range(args.rounds):
        for batch in args.batches or preset["batches"]:
            prompts = batch_prompts(model, preset, batch)
            for variant in variants:
                scheduler = scheduler_for(model, variant, args.kv_budget_mb)
                scheduler.runner.capture_graphs(batch)
                scheduler.generate(requests(prompts, 4))  # warm-up at these shapes
                scheduler.flush_cache()
                timed_requests = requests(prompts, new)
                seconds = timed(lambda s=scheduler, r=timed_requests: s.generate(r))
                tok_s = batch * new / seconds
                results[variant].setdefault(batch, []).append(tok_s)
                print(f"batch {batch:4d} {variant:18s} {tok_s:10.1f} tok/s", flush=True)
                del scheduler
    summary = {batch: ratios(results, batch) for batch in results[variants[0]]}
    for batch, row in summary.items():
        print(
            f"batch {batch:4d}: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in row.items() if "_over_" in k)
        )
    out = {
        "benchmark": "engine_forward_ab",
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "rounds": results,
        "best": summary,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        print(f"saved {args.out}")


def ratios(results: dict[str, dict[int, list[float]]], batch: int) -> dict[str, float]:
    """Each variant's best round at `batch`, and its ratio to HF's layers and to the lean forward
    with separate projections, where those ran."""
    best = {v: max(rounds[batch]) for v, rounds in results.items()}
    row = {f"{v}_tok_s": tok_s for v, tok_s in best.items()}
    for base in ("hf_layers", "lean_kernels_apart"):
        if base in best:
            row |= {f"{v}_over_{base}": t / best[base] for v, t in best.items() if v != base}
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--batches", type=int, nargs="*", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-budget-mb", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args()


if __name__ == "__main__":
    main()
