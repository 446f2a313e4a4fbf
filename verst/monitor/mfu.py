"""Model FLOPs utilisation of a train step on CUDA (`perf/mfu`): the model's FLOPs (6 per
parameter per token, forward and backward) over the step's forward + backward + optimizer time
and the GPU's dense bf16 peak. Tokens are each distinct prompt once (a group's prompt runs once,
`verst.train.batching.MicroBatch`) and every response token. GPUs outside the table log none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# dense bf16 tensor-core peak, TFLOP/s, by a part of the device's name (first match wins)
PEAK_BF16_TFLOPS = (
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10", 125.0),
    ("4090", 165.0),
)
TRAIN_PHASES = ("train_forward", "train_backward", "train_optimizer")


def peak_flops(device_name: str) -> float | None:
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in device_name:
            return tflops * 1e12
    return None


def model_tokens(items: Sequence[Any]) -> int:
    """Response tokens of every item, plus each distinct prompt's tokens once."""
    prompts = {tuple(i.tokens[: len(i.tokens) - i.response_length]) for i in items}
    return sum(i.response_length for i in items) + sum(len(p) for p in prompts)


def mfu_metrics(
    device: Any, n_params: int, items: Sequence[Any], seconds: dict[str, float]
) -> dict[str, float]:
    """`perf/mfu` on a CUDA device of the table; nothing elsewhere. `seconds`: the step's
    `perf/<phase>_time_s`."""
    if device.type != "cuda":
        return {}
    import torch

    peak = peak_flops(torch.cuda.get_device_name(device))
    step_s = sum(seconds.get(f"perf/{p}_time_s", 0.0) for p in TRAIN_PHASES)
    if peak is None or step_s <= 0:
        return {}
    return {"perf/mfu": 6.0 * n_params * model_tokens(items) / step_s / peak}
