"""The memory roofline of a decode step: the bytes a step must read (every weight once, and each
row's KV cache) over the device's measured memory bandwidth.

A decode step of a small model at modest batch sizes is bound by memory, not arithmetic: each
step reads every projection's weights (the LM head included; the input embedding only at the
rows fed) and every running row's cached keys and values. `decode_roofline_tok_s` is the
throughput a step that did nothing but those reads, at the bandwidth a plain device copy
reaches, would give; `bench/engine_throughput.py` prints each measured figure next to it.
Prefill is left out (at 128 prompt and 256 new tokens it is a few percent of a run).
"""

from __future__ import annotations

import statistics
import time

import torch


def memory_bandwidth(device: str, nbytes: int | None = None, repeats: int = 10) -> float:
    """Bytes a second a device copy of `nbytes` (default 1 GiB on CUDA, 256 MiB on the CPU)
    moves (read + written), median of `repeats`."""
    nbytes = nbytes or (1 << 30 if device == "cuda" else 1 << 28)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch: page faults on the CPU, lazy allocation
    seconds = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(seconds)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied LM head reads the
    embedding matrix), less an untied input embedding (read at the fed rows only)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of one token's keys and values over all layers."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize


def decode_roofline_tok_s(
    model: torch.nn.Module, batch: int, prompt_tokens: int, new_tokens: int, bandwidth: float
) -> float:
    """Tokens a second of decode steps that only read their weights and KV at `bandwidth`, the
    rows' context at its mean over the run (the prompt and half the new tokens)."""
    context = prompt_tokens + new_tokens / 2
    step_bytes = weight_bytes_per_step(model) + batch * context * kv_bytes_per_token(model)
    return batch * bandwidth / step_bytes
