"""Where a broadcast whole update's time goes, without HTTP: the trainer's side (cuda:0) and an
in-process serving engine's side (cuda:1) in two processes, each profiled with `torch.profiler`
(host and device). The bare NCCL broadcast of the same bytes is `tests/gpu/test_broadcast_nccl.py`'s
printed figure.

    python bench/broadcast_phases.py --out bench/results/broadcast_phases_h200x2.json

Needs two GPUs. The model is `bench/weight_sync.py`'s Qwen2-0.5B-shaped bf16 one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROUNDS = 12
PROFILED = 3


def profiled(rounds: list[float], run, sync) -> list[dict]:
    """`run()` ROUNDS times (timed into `rounds`), then PROFILED more under the profiler; the
    operators by host time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(ROUNDS):
        sync()
        start = time.perf_counter()
        run()
        sync()
        rounds.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            run()
            sync()
    rows = sorted(prof.key_averages(), key=lambda e: e.cpu_time_total, reverse=True)[:25]
    return [
        {
            "name": e.key[:120],
            "calls": e.count // PROFILED,
            "host_ms_per_round": e.cpu_time_total / 1e3 / PROFILED,
            "device_ms_per_round": getattr(e, "device_time_total", 0.0) / 1e3 / PROFILED,
        }
        for e in rows
    ]


def timed(owner: object, names: list[str], seconds: dict[str, list[float]]) -> None:
    """Each of `owner`'s functions `names` (sync or async) times its calls into `seconds`."""
    import inspect

    for name in names:
        inner = getattr(owner, name)
        if inspect.iscoroutinefunction(inner):

            async def wrapper(*args, _inner=inner, _name=name, **kwargs):
                start = time.perf_counter()
                try:
                    return await _inner(*args, **kwargs)
                finally:
                    seconds.setdefault(_name, []).append(time.perf_counter() - start)
        else:

            def wrapper(*args, _inner=inner, _name=name, **kwargs):
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    seconds.setdefault(_name, []).append(time.perf_counter() - start)

        setattr(owner, name, wrapper)


def per_round_ms(seconds: dict[str, list[float]], rounds: int) -> dict[str, dict[str, float]]:
    return {
        name: {"calls": len(s) / rounds, "host_ms_per_round": 1e3 * sum(s) / rounds}
        for name, s in seconds.items()
    }


def raw_rounds(group, buffers: list[torch.Tensor], device: torch.device, barrier) -> list[float]:
    """ROUNDS bare broadcasts of `buffers` (rank 0 sends them, rank 1 receives into them), the
    same bytes as a whole update's buckets: the link's figure between these two processes."""
    sync, times = synchronizer(device), []
    for _ in range(ROUNDS):
        barrier.wait()
        sync()
        start = time.perf_counter()
        for buffer in buffers:
            group.broadcast(buffer, 0).wait()
        sync()
        times.append(time.perf_counter() - start)
    return times


def synchronizer(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def engine_side(model_dir: str, port: int, barrier, queue, sizes, on_cuda: bool) -> None:
    from verst.engine.serving import ServingEngine
    from verst.fleet.loop_thread import LoopThread

    device = torch.device("cuda:1" if on_cuda else "cpu")
    if on_cuda:
        torch.cuda.set_device(1)
    loop = LoopThread("serving")  # the profiler runs on this (the main) thread
    serving = ServingEngine.from_model_dir(
        model_dir,
        device=device,
        dtype=torch.bfloat16 if on_cuda else torch.float32,
        kv_cache_bytes=4 << 30 if on_cuda else 64 << 20,
    )
    loop.run(serving.start())
    import verst.engine.weight_updates as updates

    seconds: dict[str, list[float]] = {}
    timed(updates, ["receive_header", "receive_bucket"], seconds)
    timed(serving, ["pause", "resume", "_update_weights"], seconds)
    timed(serving.scheduler, ["update_weights_from_tensors", "flush_cache"], seconds)
    timed(torch.cuda, ["synchronize"], seconds)
    ok, message = loop.run(
        serving.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            backend="nccl" if on_cuda else "gloo",
        )
    )
    assert ok, message

    def run() -> None:
        barrier.wait()
        ok, message = loop.run(
            serving.update_weights_whole_from_distributed(
                group_name="weight_update_group",
                pause_mode="retract",
                flush_cache=True,
                weight_version="1",
                continue_generation=True,
            )
        )
        assert ok, message

    rounds: list[float] = []
    table = profiled(rounds, run, synchronizer(device))
    group = serving._groups["weight_update_group"]
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes.get()]
    raw = raw_rounds(group, buffers, device, barrier)
    loop.run(serving.stop())
    loop.close()
    calls = per_round_ms(seconds, ROUNDS + PROFILED)
    ms = {"rounds_ms": [r * 1e3 for r in rounds], "raw_ms": [r * 1e3 for r in raw]}
    queue.put(("engine", {**ms, "operators": table, "calls": calls}))


def trainer_side(model_dir: str, port: int, barrier, queue, sizes, on_cuda: bool) -> None:
    from weight_sync import trained_weights

    from verst.sync.broadcast import BroadcastTransport, create_group
    from verst.sync.buckets import bucketed

    device, backend = ("cuda:0", "nccl") if on_cuda else ("cpu", "gloo")
    if on_cuda:
        torch.cuda.set_device(0)
    named = trained_weights(Path(model_dir), torch.bfloat16 if on_cuda else torch.float32, device)
    transport = BroadcastTransport(master_port=port, backend=backend)
    transport.group = create_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, backend=backend
    )
    rounds: list[float] = []
    import verst.sync.broadcast as broadcast

    seconds: dict[str, list[float]] = {}
    timed(broadcast, ["send_header", "send_bucket"], seconds)

    def run() -> None:
        barrier.wait()
        transport._send_whole(lambda: named.items())

    table = profiled(rounds, run, synchronizer(torch.device(device)))
    flats = [
        torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
        for bucket in bucketed(named.items(), transport.bucket_bytes)
    ]
    sizes.put([flat.numel() for flat in flats])
    raw = raw_rounds(transport.group, flats, torch.device(device), barrier)
    calls = per_round_ms(seconds, ROUNDS + PROFILED)
    ms = {"rounds_ms": [r * 1e3 for r in rounds], "raw_ms": [r * 1e3 for r in raw]}
    queue.put(("trainer", {**ms, "operators": table, "calls": calls}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, a smoke run"
    )
    args = parser.parse_args()
    on_cuda = args.device == "cuda"
    if on_cuda and torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    from weight_sync import random_model_dir

    from verst.fleet.launcher import free_port

    root = Path(tempfile.mkdtemp(prefix="verst-broadcast-phases-"))
    model_dir, _ = random_model_dir(root, args.device, 0.05)
    ctx = mp.get_context("spawn")
    barrier, queue, sizes, port = ctx.Barrier(2), ctx.Queue(), ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=side, args=(str(model_dir), port, barrier, queue, sizes, on_cuda))
        for side in (engine_side, trainer_side)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    for side, result in results.items():
        rounds = result["rounds_ms"]
        median, best = statistics.median(rounds), min(rounds)
        raw = statistics.median(result["raw_ms"])
        print(
            f"{side}: whole update {median:.2f} ms median, {best:.2f} best; the same bytes "
            f"broadcast bare {raw:.2f} ms median ({raw / median:.2f} of the update)"
        )
        for name, row in result["calls"].items():
            print(f"  {row['host_ms_per_round']:8.3f} host ms {row['calls']:5.1f}x  {name}")
        for row in result["operators"][:15]:
            print(
                f"  {row['host_ms_per_round']:8.3f} host ms {row['device_ms_per_round']:8.3f} "
                f"device ms {row['calls']:5d}x  {row['name']}"
            )
    name = "h200x2" if on_cuda else "cpu"
    out = args.out or Path(__file__).parent / "results" / f"broadcast_phases_{name}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
