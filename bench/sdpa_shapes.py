"""SDPA with a mask on a shape seen for the first time, per backend, on CUDA.

cuDNN's attention builds an execution plan for every new shape on its first call; the engine's
prefill and the trainer's passes meet new lengths all the time, so they run
`verst.models.forward.SHAPE_FREE_SDPA` instead. Forward and backward of a Qwen2-0.5B-shaped
attention (8 rows, 14 query heads, 2 KV heads, head dim 64, bf16) with a boolean causal mask at
`--trials` lengths from 700 up, each length new to the backend; each call timed, then the same
shape again. Medians (the first length left out), and the ratio new / again.

    python bench/sdpa_shapes.py --out bench/results/sdpa_shapes_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "default": None,  # PyTorch's choice (cuDNN on an H200 with a mask)
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
}


def timed_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def attention_call(length: int, backends: list[SDPBackend] | None):
    def tensor(heads: int) -> torch.Tensor:
        shape = (8, heads, length, 64)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = tensor(14), tensor(2), tensor(2)
    mask = torch.ones(length, length, device="cuda", dtype=torch.bool).tril()
    mask_B_1_L_L = mask[None, None].expand(8, 1, length, length)

    def call() -> None:
        keys, values = k.repeat_interleave(7, 1), v.repeat_interleave(7, 1)
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_B_1_L_L)
        out.float().sum().backward()

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for offset, (name, backends) in enumerate(BACKENDS.items()):
        first, again = [], []
        for trial in range(args.trials):
            call = attention_call(700 + 37 * trial + 11 * offset, backends)  # new to every backend
            first.append(timed_ms(call))
            again.append(timed_ms(call))
        new_ms, again_ms = statistics.median(first[1:]), statistics.median(again[1:])
        results[name] = {
            "new_shape_ms": new_ms,
            "same_shape_ms": again_ms,
            "new_over_same": new_ms / again_ms,
            "first": first,
            "again": again,
        }
        print(
            f"{name:10s} new shape {new_ms:8.2f} ms   same shape {again_ms:7.2f} ms   "
            f"{new_ms / again_ms:6.1f}x",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
