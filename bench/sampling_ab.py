"""The engine's sampler, A/B: PyTorch's path (`sample_next_tokens`) against the fused Triton
kernel (`verst/engine/kernels/cuda_sampling.py`), each called as the scheduler calls it
(`sample_rows`: per-row temperatures, and for the kernel one seed per row drawn on the device).

Logits are float32 [B, vocabulary] (random, scaled like a model's), as the runner gives them;
every row samples at `--temperature` and none truncates (the kernel's case). Variants:
- `torch`: `sample_rows` without the kernel (today's path on the CPU and for truncating rows);
- `fused`: `sample_rows` with `fused_sample` at its default chunk (columns per program);
- `fused_chunk<N>` for each `--chunks N` (0: one program per row), to choose the chunk.

On CUDA each measurement is `--iters` back-to-back calls between two CUDA events, after
`--warmup` calls; the variants alternate over `--repeats` rounds and each keeps its best.
Before timing, the kernel's log-probs are checked against `torch.log_softmax`. On the CPU
only `torch` runs (a smoke check; timed with the wall clock).

    python bench/sampling_ab.py --out bench/results/sampling_ab_h200.json
    python bench/sampling_ab.py --batches 1 4 --iters 2 --warmup 1 --repeats 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from verst.engine.kernels.cuda_sampling import DEFAULT_CHUNK, QUADS, fused_sample
from verst.engine.sampling import SamplingParams, sample_rows

REPO = Path(__file__).resolve().parent.parent
QWEN2_VOCAB = 151_936

Sampler = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def variants(logits_B_V: torch.Tensor, args: argparse.Namespace) -> dict[str, Sampler]:
    """Each variant as one call of `sample_rows` on these logits."""
    B = logits_B_V.shape[0]
    params = [SamplingParams(temperature=args.temperature)] * B
    own: list[torch.Generator | None] = [None] * B
    generator = torch.Generator(device=logits_B_V.device).manual_seed(0)
    fused = {"torch": None}
    if logits_B_V.device.type == "cuda":
        fused["fused"] = fused_sample
        for chunk in args.chunks:
            whole_row = -(-logits_B_V.shape[1] // (4 * QUADS)) * 4 * QUADS
            fused[f"fused_chunk{chunk}"] = functools.partial(fused_sample, chunk=chunk or whole_row)
    return {
        name: functools.partial(sample_rows, logits_B_V, params, own, generator, fused=sampler)
        for name, sampler in fused.items()
    }


def check_logprobs(logits_B_V: torch.Tensor, sampler: Sampler, temperature: float) -> None:
    tokens_B, logprobs_B = sampler()
    expected_B = torch.log_softmax(logits_B_V / temperature, -1).gather(1, tokens_B[:, None])
    torch.testing.assert_close(logprobs_B, expected_B[:, 0], atol=1e-5, rtol=1e-6)


def time_per_call_us(sampler: Sampler, iters: int, device: str) -> float:
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            sampler()
        return (time.perf_counter() - start) / iters * 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        sampler()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / iters * 1e3


def run_batch(batch: int, args: argparse.Namespace, device: str) -> dict:
    generator = torch.Generator(device=device).manual_seed(batch)
    logits_B_V = torch.randn(batch, args.vocab, generator=generator, device=device) * 4
    samplers = variants(logits_B_V, args)
    for name, sampler in samplers.items():
        if name != "torch":
            check_logprobs(logits_B_V, sampler, args.temperature)
        for _ in range(args.warmup):
            sampler()
    best_us = {name: float("inf") for name in samplers}
    for _ in range(args.repeats):
        for name, sampler in samplers.items():
            best_us[name] = min(best_us[name], time_per_call_us(sampler, args.iters, device))
    row: dict = {"batch": batch}
    for name, us in best_us.items():
        row[f"{name}_us"] = us
        if name != "torch":
            row[f"torch_over_{name}"] = best_us["torch"] / us
    print(
        f"batch {batch}: "
        + " | ".join(f"{name} {us:.1f} us" for name, us in best_us.items())
        + "".join(f" | torch/{n} {row[f'torch_over_{n}']:.2f}x" for n in best_us if n != "torch"),
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=QWEN2_VOCAB)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--chunks", type=int, nargs="*", default=[4 * DEFAULT_CHUNK, 0],
        help=f"more chunk sizes to time the kernel at (default chunk {DEFAULT_CHUNK}; 0: a row)",
    )  # fmt: skip
    parser.add_argument("--iters", type=int, default=200, help="calls per measurement")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="alternated rounds, best kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("--temperature must be > 0 (the bench times sampling, not the argmax)")
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [run_batch(batch, args, device) for batch in args.batches]
    result = {
        "bench": "sampling_ab",
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "vocab": args.vocab,
        "temperature": args.temperature,
        "default_chunk": DEFAULT_CHUNK,
        "iters": args.iters,
        "repeats": args.repeats,
        "rows": rows,
    }
    out = args.out or REPO / "bench" / "results" / f"sampling_ab_{device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
