"""Fixtures shared by the engine and scheduler tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import transformers

from tests.servers import LoopThread
from verst.engine.kv_pool import KVPool

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the suite runs in one pytest-xdist worker per core (README): a worker's own torch work
    # takes one thread, or the workers' thread pools would contend for the cores
    torch.set_num_threads(1)


def tiny_qwen3() -> transformers.Qwen3ForCausalLM:
    """A tiny random Qwen3 (vocab 64, 2 layers) on the CPU, in float32 and eval mode."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        # Larger than the default so the random model is peaked, not near-uniform: greedy
        # parity then tests real choices rather than near-ties.
        initializer_range=0.2,
    )
    return transformers.Qwen3ForCausalLM(config).float().eval()


def tiny_qwen3_pool(dtype: torch.dtype, num_pages: int = 64) -> KVPool:
    """A CPU KV pool shaped for `tiny_qwen3` (pages of 4 tokens)."""
    return KVPool(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        num_pages=num_pages,
        dtype=dtype,
        device="cpu",
    )


# Module scope, not session: test_engine's weight-update test copies new weights into this model
# in place (restoring them afterwards), so each module gets its own copy.
@pytest.fixture(scope="module")
def model() -> transformers.Qwen3ForCausalLM:
    return tiny_qwen3()


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    """An event loop on a thread, for tests that drive servers and clients from sync code."""
    thread = LoopThread()
    yield thread
    thread.close()
