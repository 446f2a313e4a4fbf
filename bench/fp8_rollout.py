"""FP8 rollout (`engine.quantization: fp8`) against the bf16 engine, in one process: tokens/s at
each batch, the ratio, and how far the fp8 engine's log-probs of its sampled tokens are from a
bf16 full forward of the same sequences (the gap TIS corrects in training).

Each batch runs both engines on the same prompts (128 in, 256 out on the h200 preset; sampling
at temperature 1, EOS ignored), alternated `--repeats` rounds after an untimed warm-up (decode
CUDA graphs captured, fp8 copies made), best round kept. The log-prob gap is measured on the
smallest batch's sequences, against the HF forward of the bf16 model; the bf16 engine's own gap
is the floor (kernels and batch shapes alone).

    python bench/fp8_rollout.py --preset h200        # one GPU, Qwen2-0.5B-shaped, bf16
    python bench/fp8_rollout.py --preset cpu         # ~1 min on 2 CPU cores, 1 thread

Saves bench/results/fp8_rollout_<preset>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import (  # noqa: E402
    PRESETS,
    batch_prompts,
    build_model,
    cold_generate,
    new_scheduler,
    requests,
    timed,
    warm_scheduler,
)

FP8_PRESETS = {
    "h200": dict(PRESETS["h200"], batches=[64, 256], kv_budget_mb=4096),
    # bf16 on the CPU, where `torch._scaled_mm` has no fp8 kernel of its own: the CPU run
    # checks the bench and the gap; its speed ratio is no GPU's
    "cpu": dict(
        model=dict(
            vocab_size=2048,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=384,
        ),
        dtype="bfloat16",
        batches=[16, 64],
        prompt_tokens=32,
        new_tokens=64,
        kv_budget_mb=128,
    ),
}
VARIANTS = ("none", "fp8")  # engine.quantization


def engines(model, preset, dtype, device, batch: int, prompts: list[list[int]]) -> dict:
    """One scheduler per quantization, warmed at this batch's shapes (untimed)."""
    made = {}
    budget_bytes = preset["kv_budget_mb"] << 20
    for quantization in VARIANTS:
        scheduler = new_scheduler(model, dtype, device, budget_bytes, quantization=quantization)
        warm_scheduler(scheduler, prompts, batch)
        made[quantization] = scheduler
    return made


def run_batch(model, args, preset, dtype, device, batch: int) -> tuple[dict, dict]:
    """tok/s of both engines at `batch` (best of the alternated rounds), and the engines."""
    prompts = batch_prompts(model, preset, batch)
    new = preset["new_tokens"]
    schedulers = engines(model, preset, dtype, device, batch, prompts)
    best = {q: float("inf") for q in VARIANTS}
    for _ in range(args.repeats):
        for q, scheduler in schedulers.items():
            best[q] = min(best[q], timed(partial(cold_generate, scheduler, prompts, new)))
    row = {
        "batch": batch,
        "bf16_tok_s": batch * new / best["none"],
        "fp8_tok_s": batch * new / best["fp8"],
    }
    row["fp8_over_bf16"] = row["fp8_tok_s"] / row["bf16_tok_s"]
    print(
        f"batch {batch:4d}: bf16 {row['bf16_tok_s']:9.1f} tok/s | fp8 {row['fp8_tok_s']:9.1f} "
        f"tok/s | fp8/bf16 {row['fp8_over_bf16']:.3f}x",
        flush=True,
    )
    return row, schedulers


@torch.no_grad()
def logprob_gap(model, scheduler, prompts: list[list[int]], new: int, chunk: int) -> dict:
    """|engine log-prob − bf16 full forward log-prob| over every sampled token: mean and max."""
    outputs = scheduler.generate(requests(prompts, new))
    pairs = list(zip(prompts, outputs, strict=True))
    length = len(prompts[0])  # every prompt of a batch has the same length
    gaps = []
    for start in range(0, len(pairs), chunk):
        part = pairs[start : start + chunk]
        ids = torch.tensor([p + o.output_ids for p, o in part], device=model.device)
        logits = model(ids).logits[:, length - 1 : -1].float()
        full = logits.log_softmax(-1).gather(2, ids[:, length:, None])[..., 0]
        engine = torch.tensor([o.output_token_logprobs for _, o in part], device=model.device)
        gaps.append((full - engine).abs().flatten())
        del logits
    gap = torch.cat(gaps)
    return {"tokens": gap.numel(), "mean": float(gap.mean()), "max": float(gap.max())}


def main() -> None:
    args = parse_args()
    preset = FP8_PRESETS[args.preset]
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, preset["dtype"])
    model = build_model(preset["model"], dtype, device)
    rows, gap = [], {}
    for batch in preset["batches"]:
        row, schedulers = run_batch(model, args, preset, dtype, device, batch)
        rows.append(row)
        if not gap:  # the smallest batch's sequences: prompts of one length, as batched
            prompts = batch_prompts(model, preset, batch)
            for name, q in (("fp8_engine", "fp8"), ("bf16_engine", "none")):
                gap[name] = logprob_gap(
                    model, schedulers[q], prompts, preset["new_tokens"], args.chunk
                )
            print(
                "log-prob gap vs the bf16 forward (mean / max over "
                f"{gap['fp8_engine']['tokens']} tokens): "
                + " | ".join(f"{n} {g['mean']:.4f} / {g['max']:.4f}" for n, g in gap.items()),
                flush=True,
            )
        del schedulers
        if device == "cuda":
            torch.cuda.empty_cache()
    save(args, preset, device, rows, gap)


def save(args, preset: dict, device: str, rows: list[dict], gap: dict) -> None:
    result = {
        "bench": "fp8_rollout",
        "preset": args.preset,
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": preset["dtype"],
        "model": preset["model"],
        "prompt_tokens": preset["prompt_tokens"],
        "new_tokens": preset["new_tokens"],
        "repeats": args.repeats,
        "batches": rows,
        "logprob_gap_vs_bf16_forward": gap,
    }
    out = args.out or Path(__file__).parent / "results" / f"fp8_rollout_{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(FP8_PRESETS), default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="best of N alternated rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--chunk", type=int, default=8, help="sequences per bf16 forward of the log-prob gap"
    )
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


if __name__ == "__main__":
    main()
