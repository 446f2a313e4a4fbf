"""trainer.kernels=liger refuses what it cannot run, naming the cause (CUDA runs are in
tests/gpu/test_liger_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from tests.test_trainer import tiny_model
from verst.config import RunConfig
from verst.train.liger import apply_liger


def test_liger_on_the_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="need CUDA"):
        apply_liger(tiny_model(), torch.device("cpu"))


@pytest.mark.parametrize(
    ("trainer", "cause"),
    [
        ({"backend": "megatron"}, "Megatron's layers are its own"),
        ({"true_on_policy": True}, "invariant forward runs its own kernels"),
    ],
)
def test_combinations_it_cannot_serve_are_refused(trainer: dict, cause: str) -> None:
    with pytest.raises(ValueError, match=cause):
        RunConfig.model_validate({"trainer": {"kernels": "liger", **trainer}})
