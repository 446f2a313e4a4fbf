"""Weight-sync cost per transport, against the machine's own limits, in one run.

For a set of tensors of `--gb` GB (fp32 by default) it measures:
- the limits: memcpy bandwidth (`copy_` between two buffers) and raw disk write + fsync;
- colocated zero-copy (`verst.sync.colocated.share_storage`: engine and trainer share storage):
  a push is a version bump;
- in-process copy (the bucketed copy `ColocatedTransport` and the embedded engine's sync fall
  back to): `copy_` of every tensor into the engine's;
- disk (`verst.sync.disk`): publish + apply of a full snapshot, and of an XOR delta where
  `--changed` of the tensors changed;
- shared memory across processes (`ColocatedTransport` to an engine process, through
  `verst.sync.ipc.IpcBucketSender`): a `verst serve` process holding a random Qwen3-shaped
  model of about `--gb` maps the trainer's /dev/shm buffers and copies from them; the send
  alone against a memcpy of the same bytes, and the whole update two ways, alternating: verst's
  one request (pause to continue, the buffers' layouts sent once) and SGLang's calls (pause,
  flush, a request per bucket, version, continue, confirm), with each call's time.
Prints seconds and GB/s, each transport's share of its physical limit, and saves JSON.

With `--device cuda` it measures the GPU case instead: a random Qwen2-0.5B-shaped bf16 model
served by a `verst serve` process on the trainer's GPU, updated through CUDA IPC handles; the
send alone against a device memcpy of the same bytes, and the whole update in milliseconds.

    python bench/weight_sync.py [--gb 0.5] [--changed 0.1] [--dtype float32]
    python bench/weight_sync.py --device cuda --out bench/results/weight_sync_cuda_ipc.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from verst.sync.disk import DiskPublisher, apply_published

TENSOR_MB = 10
# plain NCCL broadcast between two H200s of one host, 1 GB buffers (measured there; the issue's
# figure): the link the broadcast transport's send is compared with
NCCL_REFERENCE_GB_S = 342.0
# Qwen2-0.5B's shapes (494M parameters, tied embeddings): about 0.99 GB in bf16.
QWEN2_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


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


# ---- shared tensors into a `verst serve` process ----------------------------------------------


def random_model_dir(root: Path, device: str, gb: float) -> tuple[Path, torch.dtype]:
    """A random model the engine loads: Qwen2-0.5B in bf16 on CUDA, else a Qwen3 of about
    `gb` GB in fp32 (1024 wide, as many layers as fit); with the character tokenizer."""
    import transformers

    from verst.models.tiny import ENDOFTEXT, SPECIAL_TOKENS, build_char_tokenizer

    tokenizer = build_char_tokenizer()
    eos = SPECIAL_TOKENS.index(ENDOFTEXT)
    if device == "cuda":
        config = transformers.Qwen2Config(**QWEN2_05B, eos_token_id=eos, pad_token_id=eos)
        cls, dtype = transformers.Qwen2ForCausalLM, torch.bfloat16
    else:
        per_layer = 4 * (4 * 1024 * 1024 + 3 * 1024 * 4096)
        layers = max(1, round(gb * 1e9 / per_layer))
        config = transformers.Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=64,
            max_position_embeddings=1024,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        cls, dtype = transformers.Qwen3ForCausalLM, torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype)
    model.generation_config.eos_token_id = eos
    path = root / "model"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path, dtype


def trained_weights(model_dir: Path, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """The model's weights, moved so they differ from what an engine loaded from `model_dir`."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=dtype
    ).to(device)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1e-2)
    return {n: p.detach() for n, p in model.named_parameters()}


def device_memcpy_s(
    named: dict[str, torch.Tensor], sync: Callable[[], None], repeats: int
) -> float:
    """Best time of one device copy of all of `named`'s bytes (the physical limit)."""
    src = torch.cat([t.flatten().view(torch.uint8) for t in named.values()])
    dst = torch.empty_like(src)

    def memcpy() -> None:
        dst.copy_(src)
        sync()

    memcpy()
    return min(timed(memcpy, 1) for _ in range(repeats))


def bench_shared_transport(
    root: Path, device: str, gb: float, repeats: int, bucket_mbs: tuple[int, ...] = (512,)
) -> dict:
    """The colocated transport into a `verst serve` process on this host (and GPU)."""
    import asyncio
    import statistics

    from verst.fleet import HttpEngineClient, launch_local_engines
    from verst.sync.colocated import ColocatedTransport
    from verst.sync.protocol import WeightSync

    model_dir, dtype = random_model_dir(root, device, gb)
    (engine,) = launch_local_engines(
        model_dir,
        1,
        extra_args=["--device", device, "--dtype", str(dtype).removeprefix("torch.")],
        timeout_s=600,
    )
    try:
        named = trained_weights(model_dir, dtype, device)
        nbytes = sum(t.numel() * t.element_size() for t in named.values())

        def sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        memcpy_s = device_memcpy_s(named, sync, repeats)

        async def measure() -> dict:
            steps: dict[str, list[float]] = {}
            client = _Timed(HttpEngineClient(engine.url), steps)
            # two persistent buffers of bucket_mbs[0] MB (512 by default) for each path: verst's
            # one request (pause to continue, the layout sent once) and SGLang's calls, a step each
            bucket_bytes = bucket_mbs[0] << 20
            transports = {
                path: ColocatedTransport(bucket_bytes=bucket_bytes, whole_updates=path == "one")
                for path in ("one", "stepwise")
            }
            protocols = {
                path: WeightSync([client], t, pause_mode="retract")
                for path, t in transports.items()
            }
            first = {}
            for path, protocol in protocols.items():  # maps the buffers
                first[path] = (await protocol.push(lambda: named.items(), version=1)).seconds
            sender = transports["stepwise"].ipc
            send_s, stage_s, engines_s = [], [], []
            for version in range(2, 2 + repeats):  # SGLang's request alone, a bucket each
                sync()
                start = time.perf_counter()
                await transports["stepwise"].send([client], lambda: named.items(), version)
                send_s.append(time.perf_counter() - start)
                stage_s += sender.timings["stage"]
                engines_s += sender.timings["engines"]
            push_s: dict[str, list[float]] = {"one": [], "stepwise": []}
            calls: dict[str, dict[str, list[float]]] = {"one": {}, "stepwise": {}}
            version = 2 + repeats
            for repeat in range(repeats):  # the two paths alternate, each first in turn
                order = ("one", "stepwise") if repeat % 2 == 0 else ("stepwise", "one")
                for path in order:
                    sync()
                    steps.clear()
                    report = await protocols[path].push(lambda: named.items(), version=version)
                    push_s[path].append(report.seconds)
                    for name, seconds in steps.items():
                        calls[path].setdefault(name, []).extend(seconds)
                    version += 1
            one = transports["one"].ipc
            checks = {}
            for name in ("model.norm.weight", "model.layers.0.mlp.down_proj.weight"):
                status, values = await _get_weights(engine.url, name, 4)
                expected = named[name].float().cpu()[:4].tolist()
                checks[name] = status == 200 and values == expected
            buckets = list(one.buckets_sent)
            one_timings = {k: 1e3 * statistics.median(v) for k, v in one.timings.items() if v}
            for transport in transports.values():
                transport.close()
            by_bucket = {}
            for mb in bucket_mbs[1:]:  # the send alone with other bucket sizes
                other = ColocatedTransport(bucket_bytes=mb << 20)
                times = []
                for _ in range(1 + repeats):
                    sync()
                    start = time.perf_counter()
                    await other.send([client], lambda: named.items(), version)
                    times.append(time.perf_counter() - start)
                    version += 1
                by_bucket[mb] = {"best_s": min(times[1:]), "buckets": len(other.ipc.buckets_sent)}
                other.close()
            await client.inner.close()
            return {
                "first_update_s": first,
                "stage_ms": 1e3 * statistics.median(stage_s),
                "engines_ms": 1e3 * statistics.median(engines_s),
                "one_request_timings_ms": one_timings,
                "by_bucket": by_bucket,
                "calls": calls,
                "send_s": send_s,
                "push_s": push_s,
                "buckets_bytes": buckets,
                "exact": checks,
            }

        measured = asyncio.run(measure())
    finally:
        engine.stop()
    send_best = min(measured["send_s"])
    one, stepwise = measured["push_s"]["one"], measured["push_s"]["stepwise"]
    kind = "cuda_ipc" if device == "cuda" else "shared_memory"
    per_call_ms = {
        path: {name: 1e3 * statistics.median(s) for name, s in calls.items()}
        for path, calls in measured["calls"].items()
    }
    return {
        "transport": kind,
        "model": "qwen2-0.5b-shaped bf16" if device == "cuda" else "qwen3-shaped fp32",
        "gb": nbytes / 1e9,
        "memcpy_s": memcpy_s,
        "send_s": send_best,
        "send_median_s": statistics.median(measured["send_s"]),
        # the whole update as verst runs it now: one request (pause, flush, every bucket,
        # version, continue; the layout sent once), confirmed by its answer
        "whole_update_s": min(one),
        "whole_update_median_s": statistics.median(one),
        # the same update through SGLang's calls (pause, flush, a request per bucket, version,
        # continue, confirm), alternating with it in this run
        "stepwise_whole_update_s": min(stepwise),
        "stepwise_whole_update_median_s": statistics.median(stepwise),
        "stepwise_vs_one_request_median": statistics.median(stepwise) / statistics.median(one),
        "first_update_s": measured["first_update_s"],
        "bucket_mb": bucket_mbs[0],
        "per_bucket_median_ms": {
            "stage (gather, copy, pickle)": measured["stage_ms"],
            "engines (request to answer)": measured["engines_ms"],
        },
        "one_request_median_ms": measured["one_request_timings_ms"],
        "send_by_bucket_mb": measured["by_bucket"],
        "whole_update_step_median_ms": per_call_ms["one"],
        "stepwise_step_median_ms": per_call_ms["stepwise"],
        "all_calls_s": measured["calls"],
        "send_gb_s": nbytes / 1e9 / send_best,
        "memcpy_gb_s": nbytes / 1e9 / memcpy_s,
        "send_vs_memcpy": memcpy_s / send_best,
        "buckets_bytes": measured["buckets_bytes"],
        "exact": measured["exact"],
        "all_send_s": measured["send_s"],
        "all_whole_update_s": one,
        "all_stepwise_whole_update_s": stepwise,
    }


def bench_broadcast_update(
    root: Path, device: str, gb: float, repeats: int, bucket_mb: int
) -> dict:
    """Broadcast from the trainer into a `verst serve` process: the transfer alone and the whole
    update (pause, flush, send, version, continue, confirm). CUDA: NCCL from cuda:0 to an engine
    on cuda:1, a Qwen2-0.5B-shaped bf16 model; CPU: gloo, a Qwen3-shaped fp32 model."""
    import asyncio
    import statistics

    from verst.fleet import HttpEngineClient, launch_local_engines
    from verst.fleet.launcher import free_port
    from verst.sync.broadcast import BroadcastTransport
    from verst.sync.protocol import WeightSync

    on_cuda = device == "cuda"
    if on_cuda and torch.cuda.device_count() < 2:
        raise SystemExit("--transport broadcast needs two GPUs (trainer cuda:0, engine cuda:1)")
    trainer_device, engine_device = ("cuda:0", "cuda:1") if on_cuda else ("cpu", "cpu")
    model_dir, dtype = random_model_dir(root, device, gb)
    dtype_name = str(dtype).removeprefix("torch.")
    (engine,) = launch_local_engines(
        model_dir, 1, extra_args=["--device", engine_device, "--dtype", dtype_name], timeout_s=600
    )

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    try:
        named = trained_weights(model_dir, dtype, trainer_device)
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        memcpy_s = device_memcpy_s(named, sync, repeats)

        async def measure() -> dict:
            steps: dict[str, list[float]] = {}
            client = _Timed(HttpEngineClient(engine.url), steps)
            transport = BroadcastTransport(
                master_port=free_port(),
                bucket_bytes=bucket_mb << 20,
                backend="nccl" if on_cuda else "gloo",
            )
            await transport.connect([client])
            protocol = WeightSync([client], transport, pause_mode="retract")
            first = await protocol.push(lambda: named.items(), version=1)
            send_s = []
            for version in range(2, 2 + repeats):  # SGLang's request alone, a bucket each
                sync()
                start = time.perf_counter()
                await transport.send([client], lambda: named.items(), version)
                sync()
                send_s.append(time.perf_counter() - start)
            # verst's one request and SGLang's calls alternate, each first in turn
            push_s: dict[str, list[float]] = {"one": [], "stepwise": []}
            calls: dict[str, dict[str, list[float]]] = {"one": {}, "stepwise": {}}
            version = 2 + repeats
            for repeat in range(repeats):
                for path in ("one", "stepwise") if repeat % 2 == 0 else ("stepwise", "one"):
                    transport.whole_updates = path == "one"
                    sync()
                    steps.clear()
                    push_s[path].append(
                        (await protocol.push(lambda: named.items(), version)).seconds
                    )
                    for name, seconds in steps.items():
                        calls[path].setdefault(name, []).extend(seconds)
                    version += 1
            checks = {}
            for name in ("model.norm.weight", "model.layers.0.mlp.down_proj.weight"):
                status, values = await _get_weights(engine.url, name, 4)
                checks[name] = status == 200 and values == named[name].float().cpu()[:4].tolist()
            step_ms = {
                path: {name: 1e3 * statistics.median(s) for name, s in by_call.items()}
                for path, by_call in calls.items()
            }
            await client.inner.close()
            return {
                "first": first.seconds,
                "send": send_s,
                "push": push_s,
                "steps": step_ms,
                "exact": checks,
                "buckets": list(transport.buckets_sent),
            }

        measured = asyncio.run(measure())
    finally:
        engine.stop()
    send_best = min(measured["send"])
    one, stepwise = measured["push"]["one"], measured["push"]["stepwise"]
    link = NCCL_REFERENCE_GB_S if on_cuda else None
    return {
        "transport": "broadcast_nccl" if on_cuda else "broadcast_gloo",
        "model": "qwen2-0.5b-shaped bf16" if on_cuda else "qwen3-shaped fp32",
        "gb": nbytes / 1e9,
        "bucket_mb": bucket_mb,
        "memcpy_s": memcpy_s,
        "send_s": send_best,
        "send_gb_s": nbytes / 1e9 / send_best,
        "send_vs_memcpy": memcpy_s / send_best,
        "send_vs_reference_link": nbytes / 1e9 / send_best / link if link else None,
        # the whole update as verst runs it: one request (pause, flush, every bucket behind
        # its header, version, continue), confirmed by its answer
        "whole_update_s": min(one),
        "whole_update_median_s": statistics.median(one),
        "whole_update_median_vs_reference_link": (
            nbytes / 1e9 / statistics.median(one) / link if link else None
        ),
        # the same through SGLang's calls (pause, flush, a request per bucket, version,
        # continue, confirm), alternating with it in this run
        "stepwise_whole_update_s": min(stepwise),
        "stepwise_whole_update_median_s": statistics.median(stepwise),
        "stepwise_vs_one_request_median": statistics.median(stepwise) / statistics.median(one),
        "first_update_s": measured["first"],
        "whole_update_step_median_ms": measured["steps"]["one"],
        "stepwise_step_median_ms": measured["steps"]["stepwise"],
        "all_whole_update_s": one,
        "all_stepwise_whole_update_s": stepwise,
        "buckets_bytes": measured["buckets"],
        "exact": measured["exact"],
    }


class _Timed:
    """An engine client whose every call is timed into `steps[name]` (seconds)."""

    def __init__(self, inner: object, steps: dict[str, list[float]]) -> None:
        self.inner, self.steps = inner, steps

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)

        async def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await attr(*args, **kwargs)
            finally:
                self.steps.setdefault(name, []).append(time.perf_counter() - start)

        return call


async def _get_weights(url: str, name: str, rows: int) -> tuple[int, object]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        body = {"name": name, "truncate_size": rows}
        async with session.post(url + "/get_weights_by_name", json=body) as response:
            return response.status, await response.json()


def print_shared(result: dict) -> None:
    gb = result["gb"]
    print(f"{result['transport']} into a verst serve process, {gb:.2f} GB ({result['model']}):")
    memcpy_ms = result["memcpy_s"] * 1e3
    print(f"  memcpy (limit)       {memcpy_ms:9.2f} ms  {result['memcpy_gb_s']:8.2f} GB/s")
    print(
        f"  send                 {result['send_s'] * 1e3:9.2f} ms  {result['send_gb_s']:8.2f} GB/s"
        f"  ({result['send_vs_memcpy']:.2f} x memcpy)"
    )
    for label, key in (
        ("one request", "whole_update"),
        ("SGLang's calls", "stepwise_whole_update"),
    ):
        print(
            f"  whole update, {label:15s} {result[f'{key}_s'] * 1e3:9.2f} ms (best), "
            f"{result[f'{key}_median_s'] * 1e3:.2f} ms (median)"
        )
    print(
        f"  SGLang's calls / one request (median): {result['stepwise_vs_one_request_median']:.2f}"
    )
    first = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in result["first_update_s"].items())
    print(f"  first update (maps the buffers), ms: {first}")
    per_bucket = ", ".join(f"{k} {v:.2f}" for k, v in result["per_bucket_median_ms"].items())
    print(f"  per {result['bucket_mb']} MB bucket, SGLang's request (median ms): {per_bucket}")
    one = ", ".join(f"{k} {v:.2f}" for k, v in result["one_request_median_ms"].items())
    print(f"  one request (median ms): {one}")
    for mb, other in result["send_by_bucket_mb"].items():
        best = other["best_s"]
        print(f"  send with {mb} MB buckets ({other['buckets']}): {best * 1e3:.2f} ms")
    for label, key in (("one request", "whole_update"), ("SGLang's calls", "stepwise")):
        steps = ", ".join(f"{k} {v:.2f}" for k, v in result[f"{key}_step_median_ms"].items())
        print(f"  per call, {label} (median ms): {steps}")
    print(f"  bit-exact spot checks: {result['exact']}")


def print_broadcast(result: dict) -> None:
    link = result["whole_update_median_vs_reference_link"]
    print(
        f"broadcast of {result['gb']:.2f} GB, whole update (median, best): one request "
        f"{result['whole_update_median_s'] * 1e3:.2f} ms, {result['whole_update_s'] * 1e3:.2f} ms"
        + (f" = {link:.2f} x the {NCCL_REFERENCE_GB_S:.0f} GB/s link" if link else "")
        + f"; SGLang's calls {result['stepwise_whole_update_median_s'] * 1e3:.2f} ms, "
        f"{result['stepwise_whole_update_s'] * 1e3:.2f} ms "
        f"({result['stepwise_vs_one_request_median']:.2f}x the one request)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--changed", type=float, default=0.1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed shared-tensor updates")
    parser.add_argument(
        "--bucket-mb",
        default="512",
        help="shared-tensor bucket sizes, comma-separated: the first for every measurement, the "
        "others for the send alone",
    )
    parser.add_argument(
        "--no-shared",
        action="store_true",
        help="skip colocated sync into an engine process (shared tensors; starts no engine)",
    )
    parser.add_argument(
        "--transport",
        choices=["shared", "broadcast"],
        default="shared",
        help="shared = CUDA IPC (or /dev/shm) into an engine on this device; broadcast = NCCL "
        "into an engine on a second GPU (gloo on the CPU)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results_dir = Path(__file__).parent / "results"
    bucket_mbs = tuple(int(mb) for mb in args.bucket_mb.split(","))
    if args.transport == "broadcast":
        root = Path(tempfile.mkdtemp(prefix="verst-broadcast-bench-"))
        try:
            result = bench_broadcast_update(root, args.device, args.gb, args.repeats, bucket_mbs[0])
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(result, indent=2))
        print_broadcast(result)
        name = "h200x2" if args.device == "cuda" else "cpu"
        out = args.out or results_dir / f"weight_sync_broadcast_{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"saved {out}")
        return
    if args.device == "cuda":
        root = Path(tempfile.mkdtemp(prefix="verst-ipc-bench-"))
        try:
            shared = bench_shared_transport(root, "cuda", args.gb, args.repeats, bucket_mbs)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print_shared(shared)
        out = args.out or results_dir / "weight_sync_cuda_ipc.json"
        shared["machine"] = {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(shared, indent=2))
        print(f"saved {out}")
        return
    args.out = args.out or results_dir / "weight_sync.json"
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
        shared = (
            None
            if args.no_shared
            else bench_shared_transport(root, "cpu", args.gb, args.repeats, bucket_mbs)
        )
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
    if shared is not None:
        print_shared(shared)
    out = {
        "gb": gb,
        "dtype": args.dtype,
        "changed": args.changed,
        "seconds": results,
        "rates": rates,
        "ratios": summary,
        "shared_memory": shared,
        # a shared VM: the load over the last minute, at the end of the run
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_1min_end": os.getloadavg()[0],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
