"""LoRA against full-parameter training on the same model and batch, in one run.

For one random model (CPU: the 29M-parameter Qwen3 shape of `bench/engine_throughput.py`, in
fp32; `--preset h200`: Qwen2-0.5B's shape, bf16 on CUDA) and LoRA adapters of `--rank` on every
linear layer (`all-linear`), it measures for full-parameter training and for LoRA:

- the bytes of one weight update: full, every parameter in the engines' dtype; LoRA, the
  adapter's tensors (one `AdapterUpdate`), and their ratio;
- the whole weight push, `FleetSync.push` (pause, flush, send, version, continue, confirm),
  into serving engines built as `verst train` builds them (`verst.launch.build`: `Fleet.start`,
  `FleetSync.build`), per transport that applies on the machine:
  - colocated into an in-process engine, as `verst train` builds it (on a CPU in fp32 a full
    model's engine shares the trainer's storage, so its push sends nothing), and the bucketed
    in-process copy (`ColocatedTransport` with no shared engine);
  - colocated into a `verst serve` process on the trainer's device (shared memory on the CPU,
    CUDA IPC on a GPU);
  - broadcast into a `verst serve` process (gloo on the CPU; NCCL to an engine on a second GPU,
    only when there is one);
  - disk into a `verst serve` process (full: a snapshot, then XOR deltas; LoRA: a peft
    directory loaded with /load_lora_adapter).
  Every trained tensor moves before each push (as after an optimiser step, so a delta carries
  every tensor); the first push is warm-up, then `--repeats` are timed (`--disk-repeats` for
  disk; median and min), each after a memcpy of the same bytes on the device, the limit it is
  compared with (and, for disk, a write + fsync of them);
- one `Trainer.step` (GRPO on the same synthetic batch of P prompts × G samples for both) and
  the trainer's peak memory, each variant in a fresh subprocess so that peaks do not mix: the
  RSS high-water (Linux's VmHWM, see `rss_mb`; `getrusage` elsewhere), and on CUDA
  `torch.cuda.max_memory_allocated` over the steps. The trainer is the policy (with its
  adapters), its optimiser and the step's activations; `verst train` also keeps an unadapted
  copy of the model to save checkpoints through, which is left out here.

Prints LoRA against full for each and saves JSON.

    python bench/lora.py [--rank 16] [--repeats 5] [--out bench/results/lora_cpu.json]
    python bench/lora.py --preset h200        # writes bench/results/lora_h200.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from weight_sync import QWEN2_05B  # Qwen2-0.5B's shapes (494M parameters, tied embeddings)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PRESETS = {
    "cpu": dict(
        arch="qwen3",  # the CPU model of the engine issue (bench/engine_throughput.py): 29M
        model=dict(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
        device="cpu",
        prompts=4,
        samples=4,
        prompt_tokens=16,
        response_tokens=16,
        warmup_steps=1,
        steps=6,
        repeats=5,
        disk_repeats=5,
        # torch threads of the trainer and the engines: on a 2-core VM shared with other jobs,
        # two threads each made steps 4-10x slower at random (oversubscribed OpenMP)
        threads=1,
    ),
    "h200": dict(
        arch="qwen2",
        model=QWEN2_05B,
        device="cuda",
        prompts=8,
        samples=8,
        prompt_tokens=128,
        response_tokens=256,
        warmup_steps=2,
        steps=5,
        repeats=10,
        disk_repeats=3,  # a full push through the disk is seconds at 0.99 GB
        threads=None,  # torch's default
    ),
}
VARIANTS = ("full", "lora")


# ---- the model, the config, the batch ---------------------------------------------------------


def write_model(root: Path, preset: dict) -> Path:
    """A random model of the preset's shape as an HF directory (fp32, the character tokenizer),
    which the trainer and the engines load."""
    import transformers

    from verst.models.tiny import ENDOFTEXT, SPECIAL_TOKENS, build_char_tokenizer

    tokenizer = build_char_tokenizer()
    eos = SPECIAL_TOKENS.index(ENDOFTEXT)
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[preset["arch"]]
    config = config_cls(**preset["model"], eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    model = model_cls(config)
    model.generation_config.eos_token_id = eos
    path = root / "model"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def run_config(
    model_dir: Path, preset: dict, rank: int, placement: dict, transport: str, threads: int | None
):
    """The `verst train` config of one variant (rank 0: full-parameter) and placement."""
    from verst.config import config_from_dict

    return config_from_dict(
        {
            "model": {"path": str(model_dir), "lora": {"rank": rank, "alpha": 2.0 * max(rank, 1)}},
            "trainer": {"device": preset["device"], "lr": 1e-5},
            "placement": {**placement, "engine_threads": threads},
            "sync": {"transport": transport},
            "rollout": {
                "prompts_per_step": preset["prompts"],
                "n_samples_per_prompt": preset["samples"],
                "max_new_tokens": preset["response_tokens"],
            },
            "eval": {"interval_steps": 0},
            "num_threads": threads,
        }
    )


def synthetic_batch(preset: dict, vocab_size: int, seed: int = 0) -> list:
    """P groups of G samples: each group one random prompt, random responses, group-relative
    advantages of random rewards (GRPO's), rollout log-probs in a plausible range."""
    from verst.train.batching import TrainItem

    gen = torch.Generator().manual_seed(seed)
    length = preset["response_tokens"]
    items = []
    for _ in range(preset["prompts"]):
        prompt = torch.randint(10, vocab_size, (preset["prompt_tokens"],), generator=gen).tolist()
        rewards = torch.rand(preset["samples"], generator=gen)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for reward, advantage in zip(rewards.tolist(), advantages.tolist(), strict=True):
            response = torch.randint(10, vocab_size, (length,), generator=gen).tolist()
            logprobs = (-3 * torch.rand(length, generator=gen)).tolist()
            items.append(
                TrainItem(prompt + response, length, [1] * length, logprobs, advantage, reward)
            )
    return items


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- the trainer's step and memory, in a fresh process per variant ----------------------------


def step_worker(spec: dict) -> dict:
    """One variant's `Trainer` steps on the synthetic batch (run in a subprocess of its own)."""
    from verst.models.loading import load_model_and_tokenizer
    from verst.models.lora import apply_lora
    from verst.train.trainer import Trainer

    preset = spec["preset"]
    cfg = run_config(Path(spec["model_dir"]), preset, spec["rank"], {}, "auto", spec["threads"])
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    device = torch.device(preset["device"])
    rss_after_imports_mb = rss_mb()[1]
    model, tokenizer = load_model_and_tokenizer(cfg.model, seed=0, device=device)
    if cfg.model.lora.enabled:
        apply_lora(model, cfg.model.lora)
    trainer = Trainer(
        model,
        cfg.trainer,
        cfg.loss,
        total_steps=100,
        pad_token_id=tokenizer.pad_token_id,
        temperature=cfg.rollout.temperature,
        constant_normaliser=float(preset["response_tokens"]),
        device=device,
    )
    items = synthetic_batch(preset, model.config.vocab_size)
    on_cuda = device.type == "cuda"
    rss_after_build_mb = rss_mb()[0]
    if on_cuda:
        synchronize(preset["device"])
        allocated_after_build = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    step_s, losses = [], []
    for step in range(1, 1 + preset["warmup_steps"] + preset["steps"]):
        synchronize(preset["device"])
        start = time.perf_counter()
        metrics = trainer.step(items, step=step)
        synchronize(preset["device"])
        step_s.append(time.perf_counter() - start)
        losses.append(metrics["train/loss"])
    timed = step_s[preset["warmup_steps"] :]
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    result = {
        "trained_parameters": sum(p.numel() for p in trained),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "all_step_s": step_s,
        "step_median_s": statistics.median(timed),
        "step_min_s": min(timed),
        "losses": losses,
        "rss_after_imports_mb": rss_after_imports_mb,  # the high-water before the model
        "rss_after_build_mb": rss_after_build_mb,
        "peak_rss_mb": rss_mb()[1],
    }
    if on_cuda:
        result["cuda_allocated_after_build_mb"] = allocated_after_build / 2**20
        result["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def rss_mb() -> tuple[float, float]:
    """This process's resident memory (now, high-water), MB. The high-water is Linux's VmHWM:
    `getrusage`'s ru_maxrss of a child starts at its parent's RSS when it forked (fork + exec
    keep it), so it would report the bench's own memory for a small worker."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:  # no /proc: getrusage is the best there is (kB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return 0.0, peak / (2**20 if sys.platform == "darwin" else 2**10)
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def bench_step(model_dir: Path, preset: dict, rank: int, threads: int | None) -> dict:
    spec = {"model_dir": str(model_dir), "preset": preset, "rank": rank, "threads": threads}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--step-worker", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"the step worker (rank {rank}) failed with exit code {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- weight pushes ----------------------------------------------------------------------------


def move(trainer) -> None:
    """Every trained tensor changes, as after an optimiser step."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for param in trainer.model.parameters():
            if param.requires_grad:
                data = param.data
                (data.to_local() if isinstance(data, DTensor) else data).add_(1e-4)


def update_bytes(trainer, engine_dtype: torch.dtype, lora: bool) -> int:
    """What one update carries: every parameter (full) or the adapter's tensors (LoRA), in the
    engines' dtype."""
    from verst.models.lora import is_adapter

    size = torch.empty((), dtype=engine_dtype).element_size()
    return sum(
        t.numel() * size for n, t in trainer.named_local_parameters() if not lora or is_adapter(n)
    )


class TimedSends:
    """A transport whose sends are timed: the send alone, inside the protocol's push."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds = inner, 0.0

    async def send(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        try:
            await self.inner.send(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class Memcpy:
    """One copy of `nbytes` between two buffers on the device, the in-memory limit; timed
    before each push, so that the limit and the push see the same machine."""

    def __init__(self, nbytes: int, device: str) -> None:
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)
        self.device = device
        self.samples_s: list[float] = []
        self()

    def __call__(self) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        self.dst.copy_(self.src)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.samples_s.append(seconds)
        return seconds


def time_pushes(sync, versions: Iterator[int], repeats: int, memcpy: Memcpy) -> dict:
    """A warm-up push, then `repeats` timed ones, the trainer's weights moved before each and
    a memcpy of the same bytes timed before each."""
    trainer, device = sync.trainer, memcpy.device
    sends = sync.protocol.transport = TimedSends(sync.protocol.transport)
    move(trainer)
    synchronize(device)
    start = time.perf_counter()
    sync.push(next(versions))  # first use: maps buffers, forms groups, grows the registry
    first_s = time.perf_counter() - start
    push_s, send_s, update_s, sent, memcpy_s = [], [], [], [], []
    for _ in range(repeats):
        move(trainer)
        memcpy_s.append(memcpy())
        synchronize(device)
        sends.seconds = 0.0
        start = time.perf_counter()
        metrics = sync.push(next(versions))
        synchronize(device)
        push_s.append(time.perf_counter() - start)
        send_s.append(sends.seconds)
        update_s.append(metrics["sync/update_s"])
        sent.append(int(metrics["sync/bytes"]))
    return {
        "first_push_s": first_s,
        "all_push_s": push_s,
        "push_median_s": statistics.median(push_s),
        "push_min_s": min(push_s),
        "all_send_s": send_s,  # the transport's send alone, within each push
        "send_median_s": statistics.median(send_s),
        "all_update_s": update_s,  # FleetSync's own timer (sync/update_s), on the fleet's loop
        "all_memcpy_s": memcpy_s,
        "memcpy_median_s": statistics.median(memcpy_s),
        "sync_bytes": sent[-1],
    }


@contextmanager
def built(cfg, run_dir: Path):
    """A run as `verst train` builds it (trainer, fleet of serving engines, weight sync)."""
    from verst.launch import build

    run_dir.mkdir(parents=True)
    run = build(cfg, run_dir)
    try:
        yield run
    finally:
        run.close()


def release() -> None:
    """Free what a closed run held (its engines' KV pools take half the free GPU memory)
    before the next one starts."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def other_sync(run, transport: str):
    """A `FleetSync` over the run's fleet with another transport (`FleetSync.build`)."""
    from verst.sync.fleet_sync import FleetSync

    cfg = run.cfg
    return FleetSync.build(
        cfg.sync.model_copy(update={"transport": transport}),
        placement=cfg.placement,
        pause_mode=cfg.pause_mode,
        trainer=run.policy.trainer,
        fleet=run.fleet,
        generator=run.engine,
        engine_dtype=run.sync.engine_dtype,
        run_dir=run.run_dir,
        lora=cfg.model.lora,
    )


def copying_sync(run):
    """The run's fleet updated by the colocated transport's in-process copy, no engine sharing
    the trainer's storage (what a bf16 engine, or one on CUDA, gets)."""
    from verst.sync.colocated import ColocatedTransport
    from verst.sync.fleet_sync import FleetSync

    cfg, engine_dtype = run.cfg, run.sync.engine_dtype
    return FleetSync(
        run.policy.trainer,
        run.fleet,
        transport=ColocatedTransport(bucket_bytes=cfg.sync.bucket_mb << 20, dtype=engine_dtype),
        pause_mode=cfg.pause_mode,
        engine_dtype=engine_dtype,
        generator=run.engine,
        lora=cfg.model.lora,
    )


def measured(sync, versions: Iterator[int], repeats: int, memcpy: Memcpy, close: bool) -> dict:
    try:
        row = time_pushes(sync, versions, repeats, memcpy)
    finally:
        if close:
            sync.close()
    row["zero_copy"] = bool(getattr(sync.transport, "shared", None))
    return row


def bench_pushes(model_dir: Path, preset: dict, rank: int, args, root: Path) -> dict:
    """Every transport that applies here, for one variant: {row name: timings}."""
    device, lora, threads = preset["device"], rank > 0, args.threads
    versions = itertools.count(1)
    rows: dict[str, dict] = {}
    memcpy: Memcpy | None = None

    def config(placement: dict, transport: str):
        return run_config(model_dir, preset, rank, placement, transport, threads)

    def timed(sync, close: bool = True, repeats: int = args.repeats) -> dict:
        assert memcpy is not None
        return measured(sync, versions, repeats, memcpy, close)

    variant = VARIANTS[lora]
    # built with the disk transport, so that the copy is measured before any engine shares
    # the trainer's storage (FleetSync.build's colocated transport re-points it when it can)
    with built(config({"engines": "in_process"}, "disk"), root / f"{variant}-in_process") as run:
        nbytes = update_bytes(run.policy.trainer, run.sync.engine_dtype, lora)
        memcpy = Memcpy(nbytes, device)
        rows["colocated: in-process copy"] = timed(copying_sync(run))
        rows["colocated: in-process, as verst train builds it"] = timed(
            other_sync(run, "colocated")
        )
    del run
    release()
    with built(config({"engines": "processes"}, "colocated"), root / f"{variant}-processes") as run:
        name = "CUDA IPC" if device == "cuda" else "shared memory"
        rows[f"colocated: engine process, {name}"] = timed(run.sync, close=False)
        if device == "cpu":  # NCCL cannot join two ranks on one GPU
            rows["broadcast: engine process, gloo"] = timed(other_sync(run, "broadcast"))
        rows["disk: engine process"] = timed(other_sync(run, "disk"), repeats=args.disk_repeats)
    del run
    release()
    if device == "cuda" and torch.cuda.device_count() >= 2:
        placement = {"engines": "processes", "mode": "disaggregated"}
        with built(config(placement, "broadcast"), root / f"{variant}-broadcast") as run:
            rows["broadcast: engine process on cuda:1, NCCL"] = timed(run.sync, close=False)
        del run
        release()
    for row in rows.values():
        row["bytes_as_expected"] = row["sync_bytes"] == (0 if row["zero_copy"] else nbytes)
    assert memcpy is not None
    return {"update_bytes": nbytes, "memcpy_s": min(memcpy.samples_s[1:]), "pushes": rows}


# ---- physical references ----------------------------------------------------------------------


def best_of(fn: Callable[[], None], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def disk_write_s(root: Path, nbytes: int, repeats: int) -> float:
    """Writing `nbytes` to a file and fsyncing it: the disk transport's limit."""
    payload = os.urandom(nbytes)
    path = root / "raw.bin"

    def write() -> None:
        with path.open("wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    seconds = best_of(write, repeats)
    path.unlink()
    return seconds


# ---- the report -------------------------------------------------------------------------------


def use_this_verst() -> None:
    """Subprocesses (the step workers, `verst serve` engines) import the verst this process
    imported, whatever the installed one is."""
    import verst

    tree = str(Path(verst.__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)


def machine(device: str) -> dict:
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        except OSError:  # no git on the machine
            return ""
        return out.stdout.strip()

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "gpus": torch.cuda.device_count() if device == "cuda" else 0,
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def print_pushes(full: dict, lora: dict) -> None:
    print("\nwhole push (pause, flush, send, version, continue, confirm): median (min) ms;")
    print("send: the transport's send alone, median ms; limit: memcpy time / push time, medians")
    cols = ("full push", "send", "limit", "LoRA push", "send", "limit", "LoRA/full")
    widths = (17, 8, 9, 17, 8, 9, 9)
    print(f"{'transport':48s}" + "".join(f" {c:>{w}s}" for c, w in zip(cols, widths, strict=True)))
    for name, f in full["pushes"].items():
        cells = []
        for row in (f, lora["pushes"][name]):
            cells.append(f"{ms(row['push_median_s'])} ({ms(row['push_min_s'])})")
            cells.append(ms(row["send_median_s"]))
            share = row["memcpy_median_s"] / row["push_median_s"]
            cells.append("zero-copy" if row["zero_copy"] else f"{share:.3f}")
        cells.append(f"{lora['pushes'][name]['push_median_s'] / f['push_median_s']:.3f}")
        print(f"{name:48s}" + "".join(f" {c:>{w}s}" for c, w in zip(cells, widths, strict=True)))


def print_report(result: dict) -> None:
    full, lora = (result["variants"][v] for v in VARIANTS)
    mb = (full["update_bytes"] / 1e6, lora["update_bytes"] / 1e6)
    model = result["model"]
    print(f"\n{model['arch']}-shaped, {model['parameters'] / 1e6:.1f}M parameters, ", end="")
    print(f"LoRA rank {result['rank']} all-linear, {model['engine_dtype']} engines")
    print(f"update bytes: full {mb[0]:.2f} MB, LoRA {mb[1]:.3f} MB (LoRA/full {mb[1] / mb[0]:.4f})")
    print(
        f"memcpy of those bytes, best: full {ms(full['memcpy_s'])}, LoRA {ms(lora['memcpy_s'])} ms"
    )
    print(f"write + fsync: full {ms(full['disk_write_s'])} ms, LoRA {ms(lora['disk_write_s'])} ms")
    print_pushes(full, lora)
    print("\ntrainer step (median of timed steps) and peak memory:")
    for name, variant in zip(VARIANTS, (full, lora), strict=True):
        step = variant["step"]
        memory = f"peak RSS {step['peak_rss_mb']:.0f} MB"
        memory += f" (after imports {step['rss_after_imports_mb']:.0f})"
        if "cuda_max_allocated_mb" in step:
            memory += f", CUDA max allocated {step['cuda_max_allocated_mb']:.0f} MB"
        trained = step["trained_parameters"] / 1e6
        print(f"  {name:4s} {step['step_median_s']:.3f} s, {trained:.2f}M trained, {memory}")
    for key, value in result["ratios"].items():
        print(f"  {key}: {value:.3f}")


def ratios(variants: dict) -> dict:
    full, lora = (variants[v]["step"] for v in VARIANTS)
    out = {
        "update_bytes lora/full": variants["lora"]["update_bytes"]
        / variants["full"]["update_bytes"],
        "step_median_s lora/full": lora["step_median_s"] / full["step_median_s"],
        "peak_rss_mb lora/full": lora["peak_rss_mb"] / full["peak_rss_mb"],
    }
    if "cuda_max_allocated_mb" in full:
        out["cuda_max_allocated_mb lora/full"] = (
            lora["cuda_max_allocated_mb"] / full["cuda_max_allocated_mb"]
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 × rank)")
    parser.add_argument("--repeats", type=int, default=None, help="timed pushes per transport")
    parser.add_argument("--disk-repeats", type=int, default=None, help="timed pushes, disk")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of the trainer and each engine"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--step-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step_worker is not None:
        print(json.dumps(step_worker(json.loads(args.step_worker))))
        return
    preset = PRESETS[args.preset]
    args.repeats = args.repeats or preset["repeats"]
    args.disk_repeats = args.disk_repeats or preset["disk_repeats"]
    args.threads = args.threads or preset["threads"]
    out = args.out or HERE / "results" / f"lora_{args.preset}.json"
    if preset["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--preset {args.preset} needs CUDA")
    use_this_verst()
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="verst-lora-bench-"))
    try:
        model_dir = write_model(root, preset)
        ranks = dict(zip(VARIANTS, (0, args.rank), strict=True))
        # first, on a quiet device: each step and its peak in a process of its own
        variants = {
            v: {"step": bench_step(model_dir, preset, r, args.threads)} for v, r in ranks.items()
        }
        print(f"steps: done at {time.perf_counter() - started:.0f} s", file=sys.stderr)
        for variant, rank in ranks.items():
            variants[variant].update(bench_pushes(model_dir, preset, rank, args, root))
            nbytes = variants[variant]["update_bytes"]
            variants[variant]["disk_write_s"] = disk_write_s(root, nbytes, 2)
            print(f"{variant}: done at {time.perf_counter() - started:.0f} s", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    engine_dtype = "bfloat16" if preset["device"] == "cuda" else "float32"
    result = {
        "preset": args.preset,
        "machine": machine(preset["device"]),
        "command": " ".join(["python", "bench/lora.py", *sys.argv[1:]]),
        "model": {
            "arch": preset["arch"],
            **preset["model"],
            "parameters": variants["full"]["step"]["parameters"],
            "engine_dtype": engine_dtype,
        },
        "rank": args.rank,
        "alpha": 2.0 * args.rank,
        "target_modules": "all-linear",
        "batch": {k: preset[k] for k in ("prompts", "samples", "prompt_tokens", "response_tokens")},
        "repeats": args.repeats,
        "disk_repeats": args.disk_repeats,
        "threads": args.threads,
        "variants": variants,
        "ratios": ratios(variants),
        "wall_s": time.perf_counter() - started,
    }
    print_report(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
