"""Time per 1,000 trajectories: the synchronous loop vs fully asynchronous mode, same hardware.

Both runs use the same placement (engine processes on devices of their own, disaggregated),
the same model, prompts, seed and batch; only `mode` differs. Response lengths are long-tailed:
a random-weight model samples until it happens to emit EOS (about one token in the vocabulary
size), so lengths are roughly geometric up to `max_new_tokens`, and the synchronous batch
waits for its longest trajectory while the asynchronous worker keeps `max_inflight` going.

    python bench/async_vs_sync.py                      # CPU: 1 engine process + the trainer
    python bench/async_vs_sync.py --device cuda --engine-devices cuda:0 --hidden 1024 ...

Prints both times and the speedup, and writes bench/results/async_vs_sync_<device>.json.
The first `--skip` steps of each run (start-up, first compilation) are left out of the times.

Length bias: each mode reports the response-length distribution (mean, p50, p90, max, and the
share truncated at `max_new_tokens`) of the samples trained, read from `samples.jsonl` (every
sample of every step is recorded), and of the samples generated (the buffer's count of every
scored group put, fully async; what was trained, sync), both over the whole run. Fully async
drops stale groups, and the long ones span the most weight versions: a trained distribution
shorter than the generated one is that bias.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from verst.config import load_config
from verst.loop import train
from verst.monitor.samples import read_samples
from verst.rollout.buffer import Lengths
from verst.types import Status

BREAKDOWN = (
    "perf/rollout_time_s",
    "perf/wait_time_s",
    "buffer/due_wait_s",
    "buffer/take_wait_s",
    "perf/train_time_s",
    "perf/sync_time_s",
    "sync/update_s",
    "rollout/inflight_mean",
    "rollout/max_inflight",
    "rollout/loop_cpu_s",
)


def trained_lengths(run_dir: Path) -> Lengths:
    """Every trained sample's response length (samples.jsonl holds every sample of a step)."""
    lengths = Lengths()
    for steps in read_samples(run_dir)[0].values():
        for row in steps:
            if row["status"] in (Status.COMPLETED.value, Status.TRUNCATED.value):
                lengths.add_length(
                    len(row["response_tokens"]), row["status"] == Status.TRUNCATED.value
                )
    return lengths


def generated_lengths(last: dict[str, float], trained: dict[str, float]) -> dict[str, float]:
    """The buffer's cumulative count of what was generated (fully async); sync trains all it
    generates."""
    if "buffer/generated_response_len_p50" not in last:
        return trained
    keys = ("mean", "p50", "p90", "max")
    return {key: last[f"buffer/generated_response_len_{key}"] for key in keys} | {
        "truncated_ratio": last["buffer/generated_truncated_ratio"]
    }


def run_mode(mode: str, args: argparse.Namespace, run_dir: Path) -> dict[str, float]:
    tiny = (
        f"{{hidden_size: {args.hidden}, num_layers: {args.layers}, num_heads: {args.heads}, "
        f"num_kv_heads: {args.kv_heads}, intermediate_size: {4 * args.hidden}, "
        f"max_position_embeddings: {args.max_new_tokens + 64}}}"
    )
    overrides = [
        f"mode={mode}",
        f"num_steps={args.steps}",
        f"seed={args.seed}",
        f"trainer.device={args.device}",
        f"model.tiny={tiny}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_staleness={args.max_staleness}",
        f"rollout.pause_mode={args.pause_mode}",
        "placement.engines=processes",
        "placement.mode=disaggregated",
        f"placement.engine_devices={json.dumps(args.engine_devices)}",
        f"sync.transport={args.transport}",
        "eval.interval_steps=0",
        "checkpoint.interval_steps=0",
        "warm_start.enabled=false",
        f"monitor.samples_per_step={args.prompts * args.n}",  # every sample: trained lengths
    ]
    if mode == "fully_async" and args.max_inflight:
        overrides.append(f"rollout.max_inflight={args.max_inflight}")
    if mode == "fully_async" and args.no_wait_for_due:
        overrides.append("rollout.wait_for_due=false")
    if args.trainer_threads:
        overrides.append(f"num_threads={args.trainer_threads}")
    if args.engine_threads:
        overrides.append(f"placement.engine_threads={args.engine_threads}")
    cfg = load_config(None, overrides)
    started = time.perf_counter()
    train(cfg, run_dir)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > args.skip]
    seconds = sum(r["perf/step_time_s"] for r in steps)
    trajectories = len(steps) * args.prompts * args.n
    lengths = [r["rollout/response_len_mean"] for r in steps]
    trained_tokens = sum(lengths) * args.prompts * args.n
    # every step trains the same number of samples: the mean of the steps' means is the run's
    trained_mean = statistics.fmean(lengths)
    trained = trained_lengths(run_dir).summary()
    loop_cpu = [r["rollout/loop_cpu_s"] for r in steps if "rollout/loop_cpu_s" in r]
    return {
        "seconds_per_1k_trajectories": 1000 * seconds / trajectories,
        # fully async: the trainer process's rollout thread, per trajectory trained
        "loop_cpu_ms_per_trajectory": 1000 * sum(loop_cpu) / trajectories if loop_cpu else None,
        "trajectories_per_s": trajectories / seconds,
        "trained_tokens_per_s": trained_tokens / seconds,
        "measured_steps": len(steps),
        "measured_seconds": seconds,
        "wall_seconds_with_startup": wall,
        "response_len_mean": trained_mean,
        "response_len_mean_per_step": lengths,
        # what the engines generated over the whole run (sync trains all of it)
        "generated_response_len_mean": rows[-1].get(
            "buffer/generated_response_len_mean", trained_mean
        ),
        "dropped_stale_response_len_mean": rows[-1].get(
            "buffer/dropped_stale_response_len_mean", 0.0
        ),
        # whole run, every step: what training got and what the engines produced
        "trained_lengths": trained,
        "generated_lengths": generated_lengths(rows[-1], trained),
        "staleness_max": max((r.get("buffer/staleness_max", 0.0) for r in steps), default=0.0),
        "staleness_mean": statistics.fmean(r.get("buffer/staleness_mean", 0.0) for r in steps),
        "dropped_stale": max((r.get("buffer/dropped_stale", 0.0) for r in steps), default=0.0),
        # where a step's time goes (means over the measured steps, where the mode logs them)
        "step_means": {
            key: statistics.fmean(r[key] for r in steps)
            for key in BREAKDOWN
            if all(key in r for r in steps)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="trainer device")
    parser.add_argument("--engine-devices", nargs="+", default=["cpu"])
    parser.add_argument("--transport", default="broadcast", choices=["broadcast", "disk"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--pause-mode", default="in_place", choices=["in_place", "retract"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument(
        "--max-inflight", type=int, default=None, help="fully async: rollout.max_inflight"
    )
    parser.add_argument(
        "--no-wait-for-due",
        action="store_true",
        help="fully async: rollout.wait_for_due=false (stale long groups are dropped)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--modes", nargs="+", default=["sync", "fully_async"])
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            results[mode] = r = run_mode(mode, args, Path(tmp) / mode)
            print(
                f"{mode:>11}: {r['seconds_per_1k_trajectories']:.1f} s / 1k traj, "
                f"{r['trained_tokens_per_s']:.0f} trained tokens/s; {r['dropped_stale']:.0f} "
                f"groups dropped stale (mean length {r['dropped_stale_response_len_mean']:.1f})",
                flush=True,
            )
            if r["loop_cpu_ms_per_trajectory"] is not None:
                print(
                    f"{'':>11}  rollout loop thread: {r['loop_cpu_ms_per_trajectory']:.2f} ms CPU "
                    f"a trajectory, {r['step_means']['rollout/loop_cpu_s']:.3f} s a step",
                    flush=True,
                )
            for what in ("trained", "generated"):
                d = r[f"{what}_lengths"]
                print(
                    f"{'':>11}  {what:>9} length mean {d['mean']:.1f}, p50 {d['p50']:.0f}, "
                    f"p90 {d['p90']:.0f}, max {d['max']:.0f}, "
                    f"{100 * d['truncated_ratio']:.1f}% at max_new_tokens",
                    flush=True,
                )
    speedup = token_speedup = None
    if set(results) == {"sync", "fully_async"}:
        sync, fully_async = results["sync"], results["fully_async"]
        speedup = sync["seconds_per_1k_trajectories"] / fully_async["seconds_per_1k_trajectories"]
        token_speedup = fully_async["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
        print(
            f"speedup fully_async / sync: {speedup:.2f}x trajectories, {token_speedup:.2f}x tokens"
        )
    print(f"load average at the end: {os.getloadavg()}")
    device_name = (
        torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor()
    )
    record = {
        "benchmark": "async_vs_sync",
        "device": device_name or args.device,
        "config": vars(args) | {"out": None},
        "results": results,
        "speedup": speedup,
        "speedup_trained_tokens": token_speedup,
        "load_average_at_end": os.getloadavg(),
    }
    tag = "cpu" if args.device == "cpu" else "cuda"
    out = args.out or Path(__file__).parent / "results" / f"async_vs_sync_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
