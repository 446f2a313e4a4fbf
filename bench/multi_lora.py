"""Multi-LoRA serving: one batch mixing 8 adapters vs the same batch on one adapter (and on the
base), in the engine's scheduler, on one model.

Every row of a batch of `--batch` prompts runs with a LoRA adapter of rank `--rank` on every
linear layer: all the same adapter (`one-adapter`), or adapter i mod 8 (`8-adapters`). The
engine runs a mixed batch in the same forward (`verst.engine.adapters`: one gathered LoRA
matmul per module), so the mixed batch should cost little more than the single-adapter one;
the issue's target is >= 0.7x its tokens/s. The base model without adapters is the reference
for what adapters cost at all. Sampling at temperature 1 with EOS ignored, so every request
generates exactly `--new-tokens`; each workload is timed `--repeats` times after an untimed
warm-up (CUDA graphs captured) and the median is reported.

    python bench/multi_lora.py                  # CPU preset (the engine bench's 29M model)
    python bench/multi_lora.py --preset h200    # Qwen2-0.5B-shaped, bf16, CUDA

Prints tokens/s and the ratios, and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
from pathlib import Path

import torch
from engine_throughput import PRESETS, build_model, new_scheduler, requests, timed

from verst.engine.scheduler import Scheduler

ADAPTERS = 8


def random_adapter(scheduler: Scheduler, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """An adapter on every linear the engine can adapt, small enough to keep outputs sane."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, linear in scheduler.adapter_registry().targets.items():
        a = torch.randn(rank, linear.in_features, generator=generator) * 0.01
        b = torch.randn(linear.out_features, rank, generator=generator) * 0.01
        tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = a, b
    return tensors


def workload(prompts: list[list[int]], new: int, adapters: list[str | None]) -> list:
    batch = requests(prompts, new)
    for i, request in enumerate(batch):
        request.lora_path = adapters[i % len(adapters)]
    return batch


def measure(
    scheduler: Scheduler, prompts, new: int, workloads: dict[str, list], repeats: int
) -> dict[str, list[float]]:
    """Seconds of each timed repeat of each workload, the workloads interleaved so that a
    slower moment of the machine hits them alike (prefix cache flushed first: no cache hits)."""
    for adapters in workloads.values():  # warm-up: kernels, graphs
        scheduler.flush_cache()
        scheduler.generate(workload(prompts, 4, adapters))
    seconds: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(repeats):
        for name, adapters in workloads.items():
            scheduler.flush_cache()
            batch = workload(prompts, new, adapters)
            seconds[name].append(timed(lambda batch=batch: scheduler.generate(batch)))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--batch", type=int, default=None, help="default: 64 (CPU), 256 (H200)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    device = "cuda" if args.preset == "h200" else "cpu"
    dtype = getattr(torch, preset["dtype"])
    batch = args.batch or (256 if device == "cuda" else 64)
    new = args.new_tokens or (preset["new_tokens"] if device == "cuda" else 64)
    model = build_model(preset["model"], dtype, device)
    scheduler = new_scheduler(model, dtype, device, (8 << 30) if device == "cuda" else 1 << 30)
    scheduler.runner.capture_graphs(batch)
    for i in range(ADAPTERS):
        tensors = random_adapter(scheduler, args.rank, seed=i)
        config = {"r": args.rank, "lora_alpha": 2 * args.rank}
        scheduler.load_adapter(f"a{i}", config, tensors, "random")
    torch.manual_seed(1)
    vocab = preset["model"]["vocab_size"]
    prompts = [torch.randint(0, vocab, (preset["prompt_tokens"],)).tolist() for _ in range(batch)]
    names = {
        "base": [None],
        "one-adapter": ["a0"],
        f"{ADAPTERS}-adapters": [f"a{i}" for i in range(ADAPTERS)],
    }
    rows = {}
    for name, seconds in measure(scheduler, prompts, new, names, args.repeats).items():
        rows[name] = {"seconds": seconds, "tok_s": batch * new / statistics.median(seconds)}
        print(f"{name:>12}: {rows[name]['tok_s']:10.0f} tok/s  (runs {seconds})", flush=True)
    mixed = rows[f"{ADAPTERS}-adapters"]["tok_s"] / rows["one-adapter"]["tok_s"]
    overhead = rows["one-adapter"]["tok_s"] / rows["base"]["tok_s"]
    print(f"{ADAPTERS} adapters mixed / one adapter: {mixed:.2f}x (target >= 0.7)")
    print(f"one adapter / base: {overhead:.2f}x")
    result = {
        "bench": "multi_lora",
        "preset": args.preset,
        "machine": platform.platform(),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "model": preset["model"],
        "dtype": preset["dtype"],
        "batch": batch,
        "prompt_tokens": preset["prompt_tokens"],
        "new_tokens": new,
        "rank": args.rank,
        "adapters": ADAPTERS,
        "threads": torch.get_num_threads(),
        "workloads": rows,
        "mixed_over_one_adapter": mixed,
        "one_adapter_over_base": overhead,
    }
    out = args.out or Path(__file__).resolve().parent / "results" / f"multi_lora_{args.preset}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
