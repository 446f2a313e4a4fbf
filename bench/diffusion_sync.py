"""A served diffusion engine's weight push: through the disk against through a broadcast group.

One `verst serve-diffusion` subprocess on a fresh DiT (`verst model create-tiny-diffusion`'s
default shape unless the flags say otherwise, untrained weights: the bytes are the same), and
the trainer's model in this process. For the full weights and for LoRA adapters (rank
`--lora-rank`, all-linear) it times a whole push as the loop runs it, version confirmed: the
disk push (`save_pretrained` or peft's files, then `/update_weights_from_disk` or
`/load_lora_adapter`) and the broadcast push (the LM's `WeightSync` over a gloo group: pause,
the buckets, version, continue, confirm). Medians of `--repeats` pushes after one warm-up.

    python bench/diffusion_sync.py [--repeats 10] [--hidden-size 64] [--num-layers 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from verst.diffusion import adapters, remote
from verst.diffusion import model as tiny
from verst.models.lora import LoraConfig

REPO = Path(__file__).resolve().parent.parent


def median_s(push, repeats: int) -> float:
    push(0)
    times = []
    for version in range(1, repeats + 1):
        start = time.perf_counter()
        push(version)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model_dir: Path, scratch: Path, lora: LoraConfig | None, repeats: int) -> dict:
    model, _ = tiny.load(model_dir)
    if lora is not None:
        adapters.adapt(model, lora)
    run_dir = scratch / ("lora" if lora else "full")
    run_dir.mkdir()
    server, client = remote.launch(str(model_dir), run_dir, torch.device("cpu"))
    try:
        sent = {}

        def disk(version: int) -> None:
            sent["disk"] = remote.push(model, client, run_dir, version, lora)

        disk_s = median_s(disk, repeats)
        push = remote.BroadcastPush(client, bucket_bytes=512 << 20, max_resends=1, lora=lora)
        try:
            broadcast_s = median_s(lambda v: sent.update(broadcast=push.push(model, v)), repeats)
        finally:
            push.close()
    finally:
        server.stop()
    row = {"bytes": sent["broadcast"], "disk_push_s": disk_s, "broadcast_push_s": broadcast_s}
    print(
        f"{'lora' if lora else 'full':4s} {row['bytes'] / 1e3:8.1f} KB: disk {disk_s * 1e3:7.1f}"
        f" ms, broadcast {broadcast_s * 1e3:7.1f} ms ({disk_s / broadcast_s:.1f}x)",
        flush=True,
    )
    return row


def main() -> None:
    default = tiny.TinyDiffusionSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=default.hidden_size)
    parser.add_argument("--num-layers", type=int, default=default.num_layers)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=str(REPO / "bench/results/diffusion_sync_cpu.json"))
    args = parser.parse_args()
    spec = tiny.TinyDiffusionSpec(hidden_size=args.hidden_size, num_layers=args.num_layers)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "tiny"
        tiny.create_tiny_diffusion(model_dir, spec, pretrain_steps=0, seed=0, log=lambda _: None)
        lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
        rows = {
            "full": measure(model_dir, Path(scratch), None, args.repeats),
            "lora": measure(model_dir, Path(scratch), lora, args.repeats),
        }
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "pushes": rows,
        "commit": commit,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
