"""GPU tests share one device: what a test leaves in PyTorch's CUDA cache is memory the next
test's engine process cannot get (a serving engine sizes its KV pool from the free memory)."""

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def release_cuda_memory() -> Iterator[None]:
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
