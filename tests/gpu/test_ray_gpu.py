"""`placement.backend: ray` on GPUs, through the public CLI on a local one-node Ray cluster
offering this machine's GPUs: each bundle's GPU is its rank's or engine's own (Ray's
CUDA_VISIBLE_DEVICES), trainer ranks form an NCCL group, and broadcast sync runs over NCCL from
the trainer's GPU to the engine's; on one GPU, a trainer rank and an engine of half a GPU each
share it (weights by CUDA IPC in sync mode, by disk fully asynchronously)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.faults import TrainProcess

pytest.importorskip("ray")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

COMMON = [
    "num_steps=6",
    "trainer.device=cuda",
    "model.tiny={hidden_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 128, max_position_embeddings: 64}",
    "data={task: addition, split: train}",
    "rollout.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "eval.interval_steps=0",
    "checkpoint.interval_steps=0",
    "placement.backend=ray",
    "placement.ray_local_nodes=[{num_cpus: 4, num_gpus: 2}]",
]


def _finish(run: TrainProcess, steps: int = 6) -> None:
    assert run.start().finish(timeout_s=600) == 0, run.output()
    assert [r["step"] for r in run.records()] == list(range(steps + 1))


@two_gpus
def test_engine_and_trainer_on_their_own_gpus_broadcast_over_nccl(tmp_path: Path) -> None:
    overrides = [
        *COMMON,
        "mode=fully_async",
        "placement.engines=processes",
        "placement.mode=disaggregated",
        "sync.transport=broadcast",
    ]
    _finish(TrainProcess(overrides, tmp_path / "run"))
    (placed,) = [json.loads(line) for line in (tmp_path / "run" / "placement.jsonl").open()]
    assert placed["bundles"] == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]


@two_gpus
def test_two_trainer_ranks_form_an_nccl_group(tmp_path: Path) -> None:
    _finish(TrainProcess([*COMMON, "placement.trainer_ranks=2"], tmp_path / "run"))


ONE_GPU = [
    *[o for o in COMMON if not o.startswith("placement.ray_local_nodes")],
    "placement.ray_local_nodes=[{num_cpus: 4, num_gpus: 1}]",
    "placement.ray_trainer_gpus=0.5",
    "placement.ray_engine_gpus=0.5",
    "placement.engines=processes",
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "layout",
    [
        ["sync.transport=colocated"],  # CUDA IPC between the rank's and the engine's processes
        ["mode=fully_async", "placement.mode=disaggregated", "sync.transport=disk"],
    ],
    ids=["sync_cuda_ipc", "fully_async_disk"],
)
def test_trainer_rank_and_engine_share_one_gpu_by_half_bundles(
    tmp_path: Path, layout: list[str]
) -> None:
    _finish(TrainProcess([*ONE_GPU, *layout], tmp_path / "run"))
    (placed,) = [json.loads(line) for line in (tmp_path / "run" / "placement.jsonl").open()]
    assert placed["bundles"] == [{"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}]
