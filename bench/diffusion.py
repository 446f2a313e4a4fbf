"""verst's diffusion engine against the plain diffusers sampling loop, and the trainer's rate.

On one tiny model (`verst model create-tiny-diffusion`'s DiT, or `--model-dir`), same dtype
(float32), torch threads, steps, guidance and resolution, for each batch size it measures
trajectories per second of:

- `diffusers`: the loop a diffusers pipeline runs, `FlowMatchEulerDiscreteScheduler` from the
  model's `scheduler/` with `set_timesteps(sigmas=...)` on verst's time grid, the model's forward
  (both branches batched when guidance > 1) and `scheduler.step`; the final images only;
- `verst ode`: `DiffusionEngine.generate` with ODE sampling (what evaluation runs); besides the
  images it keeps the latent trajectory x_0..x_n of every sample on the CPU;
- `verst flow_sde`: the engine as a Flow-GRPO rollout runs it, the `--window` first steps
  stochastic (Flow-SDE, eta 0.7), each recording its transition log-prob, plus the trajectory.

The verst ODE and diffusers images are compared (max absolute difference), so both loops do the
same arithmetic. Then the trainer's transitions per second, one `DiffusionTrainer.step` (one
optimizer update) on a batch of `--train-batch` flow_sde trajectories with `--window` trained
steps each, for Flow-GRPO and DiffusionNFT, against the bare limit: one flow-matching step
(forward, backward, AdamW) on as many transitions. Each figure is the median of `--repeats`
timed runs after one warm-up (the min is saved too; on CUDA each run ends synchronised).

    python bench/diffusion.py [--batches 1 8 32] [--steps 10] [--threads 1]
    python bench/diffusion.py --preset h200      # one GPU, a larger DiT: diffusion_h200.json

`--preset h200` is CUDA, a 64x64 DiT of hidden 512, 8 layers, 8 heads (patch 2: 1024 tokens),
batches 32 and 64, a trainer step on 64 trajectories in micro-batches of 64 transitions; any
flag given with it overrides the preset's value.
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
from collections.abc import Callable
from pathlib import Path

import torch

from verst.diffusion import model as tiny
from verst.diffusion import sde, shapes
from verst.diffusion.config import DiffusionConfig
from verst.diffusion.engine import DiffusionEngine, DiffusionRequest
from verst.diffusion.trainer import DiffusionTrainer
from verst.train.trainer import TrainerConfig

REPO = Path(__file__).resolve().parent.parent


PRESETS = {
    "h200": {
        "device": "cuda",
        "image_size": 64,
        "hidden_size": 512,
        "num_layers": 8,
        "num_heads": 8,
        "batches": [32, 64],
        "train_batch": 64,
        "micro_batch": 64,
        "out": str(REPO / "bench/results/diffusion_h200.json"),
    },
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> tuple[float, float]:
    """(median, min) seconds of `repeats` calls after one warm-up, each run synchronised."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def requests(batch: int, steps: int, guidance: float, sde_type: str, window: int) -> list:
    record = list(range(window)) if sde_type != "ode" else []
    return [
        DiffusionRequest(
            shapes.CAPTIONS[j % len(shapes.CAPTIONS)],
            "",
            steps,
            guidance,
            seed=j,
            sde_type=sde_type,
            noise_level=0.7 if sde_type != "ode" else 0.0,
            record_steps=record,
        )
        for j in range(batch)
    ]


@torch.no_grad()
def diffusers_loop(model, scheduler, batch: int, steps: int, guidance: float, size: int):
    """What a diffusers pipeline's `__call__` does for a class-conditioned flow model."""
    device = next(model.parameters()).device
    scheduler.set_timesteps(sigmas=sde.time_grid(steps)[:-1].tolist(), device=device)
    x = torch.stack(
        [
            torch.randn((3, size, size), generator=torch.Generator().manual_seed(j))
            for j in range(batch)
        ]
    ).to(device)
    labels = torch.tensor(
        [shapes.caption_class(shapes.CAPTIONS[j % len(shapes.CAPTIONS)]) for j in range(batch)],
        device=device,
    )
    null = torch.full_like(labels, shapes.NULL_CLASS)
    for t in scheduler.timesteps:
        timestep = t.expand(batch).to(x.dtype)
        if guidance == 1.0:
            v = model(x, timestep=timestep, class_labels=labels).sample
        else:
            both = model(
                torch.cat([x, x]),
                timestep=torch.cat([timestep, timestep]),
                class_labels=torch.cat([labels, null]),
            ).sample
            cond, neg = both.chunk(2)
            v = neg + guidance * (cond - neg)
        x = scheduler.step(v, t, x).prev_sample
    return x


def loops(model, scheduler, engine: DiffusionEngine, batch: int, args) -> dict:
    """The three sampling loops of one batch size, each a call that generates one batch."""
    steps, guidance, window = args.steps, args.guidance, args.window
    return {
        "diffusers": lambda: diffusers_loop(
            model, scheduler, batch, steps, guidance, engine.image_size
        ),
        "verst_ode": lambda: engine.generate(requests(batch, steps, guidance, "ode", 0)),
        "verst_flow_sde": lambda: engine.generate(
            requests(batch, steps, guidance, "flow_sde", window)
        ),
    }


def sampling(model, scheduler, engine, args) -> list[dict]:
    rows = []
    for batch in args.batches:
        row = {"batch": batch}
        variants = loops(model, scheduler, engine, batch, args)
        peer = variants["diffusers"]
        for name, fn in variants.items():
            median, low = timed(fn, args.repeats, engine.device)
            row[f"{name}_traj_per_s"] = batch / median
            row[f"{name}_traj_per_s_best"] = batch / low
        ours = torch.stack(
            [t.latents[-1] for t in variants["verst_ode"]()]  # type: ignore[union-attr]
        )
        row["max_abs_diff_ode_vs_diffusers"] = float((ours - peer().cpu()).abs().max())
        for name in ("verst_ode", "verst_flow_sde"):
            row[f"{name}_vs_diffusers"] = row[f"{name}_traj_per_s"] / row["diffusers_traj_per_s"]
        print(
            f"batch {batch:3d}: diffusers {row['diffusers_traj_per_s']:7.1f} traj/s | "
            f"verst ode {row['verst_ode_traj_per_s']:7.1f} ({row['verst_ode_vs_diffusers']:.2f}x)"
            f" | verst flow_sde {row['verst_flow_sde_traj_per_s']:7.1f} "
            f"({row['verst_flow_sde_vs_diffusers']:.2f}x) | max |diff| "
            f"{row['max_abs_diff_ode_vs_diffusers']:.1e}",
            flush=True,
        )
        rows.append(row)
    return rows


def training(model_dir: Path, engine: DiffusionEngine, args) -> dict:
    """Transitions per second of one trainer step per algorithm, and of the bare limit."""
    trajectories = engine.generate(
        requests(args.train_batch, args.steps, args.guidance, "flow_sde", args.window)
    )
    advantages = torch.randn(len(trajectories), generator=torch.Generator().manual_seed(0))
    chosen = list(range(args.window))
    transitions = len(trajectories) * len(chosen)
    out: dict = {"transitions_per_step": transitions}
    device = engine.device
    for algorithm in ("flow_grpo", "nft"):
        model, _ = tiny.load(model_dir, device)
        cfg = DiffusionConfig(
            algorithm=algorithm,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            micro_batch=args.micro_batch or transitions,
            sde_window_range=(0, args.steps),
        )
        trainer = DiffusionTrainer(model, cfg, TrainerConfig(), device, 0)
        per_trajectory = [chosen] * len(trajectories)
        step = lambda: trainer.step(trajectories, advantages, per_trajectory, step=1)  # noqa: B023,E731
        median, low = timed(step, args.repeats, device)
        out[f"{algorithm}_transitions_per_s"] = transitions / median
        out[f"{algorithm}_transitions_per_s_best"] = transitions / low
    model, _ = tiny.load(model_dir, device)
    bare = DiffusionTrainer(model, DiffusionConfig(), TrainerConfig(), device, 0)
    x0 = torch.stack([t.latents[-1] for t in trajectories]).repeat(len(chosen), 1, 1, 1)
    labels = torch.tensor([t.label for t in trajectories]).repeat(len(chosen))
    median, low = timed(lambda: bare.sft_step(x0, labels, 1), args.repeats, device)
    out["bare_fwd_bwd_transitions_per_s"] = transitions / median
    out["bare_fwd_bwd_transitions_per_s_best"] = transitions / low
    for algorithm in ("flow_grpo", "nft"):
        ratio = out[f"{algorithm}_transitions_per_s"] / out["bare_fwd_bwd_transitions_per_s"]
        out[f"{algorithm}_vs_bare"] = ratio
        print(
            f"trainer {algorithm:9s}: {out[f'{algorithm}_transitions_per_s']:7.1f} transitions/s"
            f" ({ratio:.2f}x the bare forward+backward+AdamW, "
            f"{out['bare_fwd_bwd_transitions_per_s']:.1f}/s)",
            flush=True,
        )
    return out


def model_directory(args, scratch: Path) -> Path:
    if args.model_dir is not None:
        return Path(args.model_dir)
    directory = scratch / "tiny-diffusion"
    # the weights do not change the arithmetic: no pre-training
    spec = tiny.TinyDiffusionSpec(
        image_size=args.image_size,
        patch_size=args.patch_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
    )
    tiny.create_tiny_diffusion(directory, spec, pretrain_steps=0, seed=0, log=lambda _: None)
    return directory


def parse_args() -> argparse.Namespace:
    default = tiny.TinyDiffusionSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a machine's defaults")
    parser.add_argument("--model-dir", default=None, help="default: a fresh model of the spec")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--image-size", type=int, default=default.image_size)
    parser.add_argument("--patch-size", type=int, default=default.patch_size)
    parser.add_argument("--hidden-size", type=int, default=default.hidden_size)
    parser.add_argument("--num-layers", type=int, default=default.num_layers)
    parser.add_argument("--num-heads", type=int, default=default.num_heads)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=10, help="denoising steps")
    parser.add_argument("--guidance", type=float, default=1.0, help="CFG scale (1 = off)")
    parser.add_argument("--window", type=int, default=3, help="recorded / trained steps")
    parser.add_argument("--train-batch", type=int, default=24, help="trajectories per step")
    parser.add_argument(
        "--micro-batch", type=int, default=0, help="transitions per forward (0 = all at once)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "bench/results/diffusion_cpu.json"))
    preset = parser.parse_known_args()[0].preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = model_directory(args, Path(scratch))
        from diffusers import FlowMatchEulerDiscreteScheduler

        model, meta = tiny.load(model_dir, device)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler")
        engine = DiffusionEngine(model, meta["image_size"], device)
        rows = sampling(model, scheduler, engine, args)
        train = training(model_dir, engine, args)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"}
        | {"image_size": meta["image_size"], "dtype": "float32"},
        "parameters": sum(p.numel() for p in model.parameters()),
        "sampling": rows,
        "training": train,
        "wall_time_s": time.perf_counter() - started,
        "commit": commit,
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out} ({result['wall_time_s']:.0f} s)")


if __name__ == "__main__":
    main()
