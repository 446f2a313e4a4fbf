"""`perf/mfu`: 6 FLOPs a parameter a token over the train phases' time and the GPU's peak."""

from __future__ import annotations

import pytest
import torch

from verst.monitor.mfu import mfu_metrics, model_tokens, peak_flops
from verst.train.batching import TrainItem


def item(prompt: list[int], response: list[int]) -> TrainItem:
    n = len(response)
    return TrainItem(prompt + response, n, [1] * n, [0.0] * n, 0.0)


def test_a_groups_prompt_counts_once_and_every_response_token_counts() -> None:
    items = [item([1, 2, 3], [4, 5]), item([1, 2, 3], [6]), item([9], [4, 5, 6])]
    assert model_tokens(items) == (2 + 1 + 3) + (3 + 1)


def test_peaks_are_found_by_device_name() -> None:
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some New GPU") is None


def test_mfu_is_the_closed_form_on_cuda_and_absent_on_cpu() -> None:
    items = [item([1, 2], [3, 4])]  # 4 tokens
    seconds = {"perf/train_forward_time_s": 1.0, "perf/train_backward_time_s": 2.0,
               "perf/train_optimizer_time_s": 1.0, "perf/train_time_s": 9.0}  # fmt: skip
    assert mfu_metrics(torch.device("cpu"), 10**9, items, seconds) == {}
    if not torch.cuda.is_available():
        pytest.skip("the CUDA half needs a GPU")
    peak = peak_flops(torch.cuda.get_device_name(0))
    got = mfu_metrics(torch.device("cuda", 0), 10**9, items, seconds)
    assert got == ({} if peak is None else {"perf/mfu": pytest.approx(6 * 1e9 * 4 / 4.0 / peak)})
