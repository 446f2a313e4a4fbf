"""Weight-sync cost per transport, against the machine's own limits, in one run.

For a set of tensors of `--gb` GB (fp32 by default) it measures:
- the limits: memcpy bandwidth (`copy_` between two buffers) and raw disk write + fsync;
- colocated zero-copy (`verst.sync.colocated`: engine and trainer share storage): a push is a
  version bump;
- in-process copy (the bucketed copy a colocated push falls back to, and
  `InProcessTensorTransport`): `copy_` of every tensor into the engine's;
- disk (`verst.sync.disk`): publish + apply of a full snapshot, and of an XOR delta where
  `--changed` of the tensors changed.
Prints seconds and GB/s, each transport's share of its physical limit, and saves JSON.

    python bench/weight_sync.py [--gb 0.5] [--changed 0.1] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from verst.sync.disk import DiskPublisher, apply_published

TENSOR_MB = 10


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memcpy_limit(tensors: dict[str, torch.Tensor]) -> float:
    src = torch.cat([t.flatten() for t in tensors.values()])
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src))


def disk_write_limit(root: Path, nbytes: int) -> float:
    chunk = os.urandom(16 << 20)
    path = root / "raw.bin"

    def write() -> None:
        with path.open("wb") as f:
            for _ in range(nbytes // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())

    seconds = timed(write)
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--changed", type=float, default=0.1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "weight_sync.json"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    item = torch.empty((), dtype=dtype).element_size()
    count = max(1, int(args.gb * 1e9) // (TENSOR_MB << 20))
    numel = (TENSOR_MB << 20) // item
    gen = torch.Generator().manual_seed(0)
    trainer = {f"w{i}": torch.randn(numel, generator=gen).to(dtype) for i in range(count)}
    engine = {n: torch.empty_like(t) for n, t in trainer.items()}
    nbytes = sum(t.numel() * t.element_size() for t in trainer.values())
    gb = nbytes / 1e9
    root = Path(tempfile.mkdtemp(prefix="verst-sync-bench-"))
    results: dict[str, float] = {}
    try:
        results["memcpy_s"] = memcpy_limit(trainer)
        results["disk_write_s"] = disk_write_limit(root, nbytes)
        results["colocated_zero_copy_s"] = timed(lambda: None)  # a version bump, nothing moves
        results["inprocess_copy_s"] = timed(
            lambda: [engine[n].copy_(t) for n, t in trainer.items()]
        )
        publisher = DiskPublisher(root / "pub", mode="xor")
        start = time.perf_counter()
        full = publisher.publish(trainer.items(), 1)
        results["disk_full_publish_s"] = time.perf_counter() - start
        apply = apply_published(engine, full, current_version=None)
        results["disk_full_apply_s"] = apply.seconds
        changed = list(trainer)[: max(1, int(count * args.changed))]
        for name in changed:
            trainer[name].add_(1.0)
        start = time.perf_counter()
        delta = publisher.publish(trainer.items(), 2)
        results["disk_delta_publish_s"] = time.perf_counter() - start
        results["disk_delta_apply_s"] = apply_published(engine, delta, current_version=1).seconds
        assert all(torch.equal(engine[n], t) for n, t in trainer.items())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rates = {k.removesuffix("_s") + "_gb_s": gb / v for k, v in results.items() if v > 0}
    summary = {
        "inprocess_copy_vs_memcpy": results["memcpy_s"] / results["inprocess_copy_s"],
        "disk_full_publish_vs_disk_write": results["disk_write_s"] / results["disk_full_publish_s"],
        "disk_full_apply_vs_memcpy": results["memcpy_s"] / results["disk_full_apply_s"],
    }
    for key, seconds in results.items():
        rate = f"{gb / seconds:8.2f} GB/s" if seconds > 1e-6 else "    (no data moves)"
        print(f"{key.removesuffix('_s'):24s} {seconds * 1e3:9.2f} ms  {rate}")
    for key, ratio in summary.items():
        print(f"{key:34s} {ratio:.2f}")
    out = {
        "gb": gb,
        "dtype": args.dtype,
        "changed": args.changed,
        "seconds": results,
        "rates": rates,
        "ratios": summary,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
