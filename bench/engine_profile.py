"""Where the scheduler's time goes: one timed run and one `torch.profiler` run per batch size,
on `bench/engine_throughput.py`'s preset model and workload.

For each batch it prints tokens/s, the step's wall time, the device's busy time per step (the
sum of the kernels' time, CUDA only: wall minus busy is the time the GPU waits for the host),
and the top operators by self device time (by self CPU time on the CPU). Saves JSON and, with
`--traces`, a Chrome trace per batch for `chrome://tracing` or Perfetto.

    python bench/engine_profile.py --preset h200 --batches 1 64      # one H200
    python bench/engine_profile.py --preset host --batches 16 --threads 1   # CPU, short step
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from engine_throughput import (
    PRESETS,
    batch_prompts,
    build_model,
    cold_generate,
    new_scheduler,
    warm_scheduler,
)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def profile_batch(model, preset: dict, batch: int, args: argparse.Namespace) -> dict:
    """Timed run, then a profiled run of `args.profile_tokens` new tokens, at `batch`."""
    device, dtype = args.device, getattr(torch, preset["dtype"])
    prompts = batch_prompts(model, preset, batch)
    scheduler = new_scheduler(model, dtype, device, args.kv_budget_mb << 20)
    warm_scheduler(scheduler, prompts, batch)
    new = preset["new_tokens"]
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    sync()
    started = time.perf_counter()
    cold_generate(scheduler, prompts, new)
    sync()
    wall = time.perf_counter() - started
    host = host_profile(scheduler, prompts, new, sync, args.top) if args.host_profile else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        cold_generate(scheduler, prompts, args.profile_tokens)
        sync()
    events = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[: args.top]
    # the kernels' own rows: an operator's self device time counts its kernels a second time
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in kernels) if device == "cuda" else None
    steps = args.profile_tokens  # one decode step a token (the prompts' prefill included)
    if args.traces:
        prof.export_chrome_trace(str(Path(args.out).with_suffix(f".b{batch}.trace.json")))
    return {
        "batch": batch,
        "new_tokens": new,
        "tok_s": batch * new / wall,
        "step_ms": wall / new * 1e3,
        "device_busy_ms_per_step": None if busy_us is None else busy_us / steps / 1e3,
        "top_ops": [
            {
                "name": e.key,
                "calls": e.count,
                "self_ms_per_step": getattr(e, key) / steps / 1e3,
            }
            for e in top
        ],
        "host_functions": host,
    }


def host_profile(scheduler, prompts, new: int, sync, top: int) -> list[dict]:
    """One more run under cProfile: the Python functions by their own host time per step."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    cold_generate(scheduler, prompts, new)
    sync()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, calls, tottime, cumtime, _)
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [
        {
            "function": f"{Path(file).name}:{line} {name}",
            "calls_per_step": calls / new,
            "own_ms_per_step": tottime / new * 1e3,
            "cumulative_ms_per_step": cumtime / new * 1e3,
        }
        for (file, line, name), (_, calls, tottime, cumtime, _) in rows
    ]


def report(row: dict) -> None:
    busy = row["device_busy_ms_per_step"]
    print(
        f"batch {row['batch']}: {row['tok_s']:,.0f} tok/s, {row['step_ms']:.3f} ms a step"
        + ("" if busy is None else f", device busy {busy:.3f} ms a step")
    )
    for op in row["top_ops"]:
        print(f"  {op['self_ms_per_step']:8.4f} ms/step  {op['calls']:6d} calls  {op['name']}")
    for fn in row["host_functions"] or []:
        print(
            f"  host {fn['own_ms_per_step']:8.4f} ms/step own, {fn['cumulative_ms_per_step']:8.4f}"
            f" cumulative, {fn['calls_per_step']:6.1f} calls/step  {fn['function']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="host")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-budget-mb", type=int, default=None)
    parser.add_argument("--profile-tokens", type=int, default=32, help="new tokens profiled")
    parser.add_argument("--top", type=int, default=20, help="operators listed per batch")
    parser.add_argument("--traces", action="store_true", help="save a Chrome trace per batch")
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="one more run per batch under cProfile: Python functions by own host time",
    )
    parser.add_argument("--out", default="bench/results/engine_profile.json")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    args.device = "cuda" if args.preset == "h200" else "cpu"
    if args.kv_budget_mb is None:
        args.kv_budget_mb = 40000 if args.device == "cuda" else 512
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(preset["model"], getattr(torch, preset["dtype"]), args.device)
    rows = []
    for batch in args.batches:
        rows.append(profile_batch(model, preset, batch, args))
        report(rows[-1])
    meta = {"preset": args.preset, "device": args.device, "torch": torch.__version__}
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
