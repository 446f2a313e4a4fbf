"""`sync.transport: broadcast` for diffusion: the served engine joins the LM's torch.distributed
weight-update group (gloo) and takes full weights bucket by bucket, or the adapters, confirming
the version; `verst train` runs it end to end with the engine's log-probs equal the trainer's."""

import json
from pathlib import Path

import aiohttp
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from tests.servers import LoopThread, start_app  # noqa: E402
from tests.test_diffusion_loop import overrides  # noqa: E402
from tests.test_diffusion_lora import (  # noqa: E402
    LORA,
    SPEC,
    merged_latents,
    requests,
    trained_step,
)
from verst.cli import main  # noqa: E402
from verst.diffusion import adapters, remote  # noqa: E402
from verst.diffusion import model as tiny  # noqa: E402
from verst.diffusion.config import DiffusionConfig  # noqa: E402
from verst.diffusion.engine import DiffusionEngine  # noqa: E402
from verst.diffusion.server import DiffusionClient, make_app  # noqa: E402
from verst.diffusion.trainer import DiffusionTrainer  # noqa: E402
from verst.train.trainer import TrainerConfig  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("diffusion-broadcast") / "tiny"
    tiny.create_tiny_diffusion(directory, SPEC, pretrain_steps=2, seed=0, log=lambda _: None)
    return directory


def full_step(model_dir: Path) -> DiffusionTrainer:
    """A full-parameter trainer after one Flow-GRPO step that moved its weights."""
    model, meta = tiny.load(model_dir)
    trajectories = DiffusionEngine(model, meta["image_size"]).generate(requests())
    trainer = DiffusionTrainer(
        model, DiffusionConfig(clip_range=1.0), TrainerConfig(lr=5e-2), torch.device("cpu"), 0
    )
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    trainer.step(trajectories, advantages, [[0, 1, 2]] * len(trajectories), step=1)
    return trainer


def served(model_dir: Path, loop: LoopThread) -> tuple[DiffusionEngine, DiffusionClient, object]:
    base, meta = tiny.load(model_dir)  # the served engine starts from the model directory
    engine = DiffusionEngine(base, meta["image_size"])
    runner, url = loop.run(start_app(make_app(engine, str(model_dir))))
    return engine, DiffusionClient(url), runner


@pytest.mark.parametrize("lora", [False, True])
def test_broadcast_push_installs_the_trainers_weights(model_dir, lora):
    trainer = trained_step(model_dir)[0] if lora else full_step(model_dir)
    loop = LoopThread()
    engine, client, runner = served(model_dir, loop)
    push = remote.BroadcastPush(
        client, bucket_bytes=16 << 10, max_resends=1, lora=LORA if lora else None
    )
    try:
        sent = push.push(trainer.model, 3)
        assert engine.weight_version == client.weight_version == 3
        if lora:  # the adapters alone, in one bucket, injected into the served base
            state = adapters.adapter_state(trainer.model)
            assert push.transport.buckets_sent == [sent]
            assert sent == sum(t.numel() * 4 for t in state.values())
            expected = merged_latents(model_dir, trainer)
        else:  # every parameter, bucket by bucket
            assert len(push.transport.buckets_sent) > 1
            assert sent == sum(p.numel() * 4 for p in trainer.model.parameters())
            for name, param in engine.model.named_parameters():
                assert torch.equal(param, dict(trainer.model.named_parameters())[name]), name
            expected = [t.latents for t in DiffusionEngine(trainer.model, 8).generate(requests())]
        for mine, theirs in zip(client.generate(requests()), expected, strict=True):
            torch.testing.assert_close(mine.latents, theirs, atol=1e-5, rtol=0)
        push.push(trainer.model, 4)  # the group stays: a second push reuses it
        assert engine.weight_version == 4 and push.transport.connects == 1
    finally:
        push.close()
        loop.run(runner.cleanup())
        loop.close()


def test_weight_routes_answer_400_naming_the_field(model_dir):
    loop = LoopThread()
    _, client, runner = served(model_dir, loop)

    async def post(path: str, body: dict) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            async with session.post(client.base_url + path, json=body) as response:
                return response.status, (await response.json())["error"]["message"]

    bucket = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
    try:
        assert loop.run(post("/update_weights_from_distributed", bucket)) == (
            400,
            "group_name: no weights update group 'weight_update_group': call init first",
        )
        status, message = loop.run(post("/update_weights_from_distributed", {"names": []}))
        assert status == 400 and "names, dtypes and shapes" in message
        status, message = loop.run(post("/init_weights_update_group", {"master_port": 1}))
        assert status == 400 and message == "master_address: Field required"
        status, message = loop.run(post("/update_weight_version", {"new_version": "v2"}))
        assert status == 400 and message.startswith("new_version: ")
        status, message = loop.run(post("/pause_generation", {"mode": "sleep"}))
        assert status == 400 and "mode must be one of" in message
    finally:
        loop.run(runner.cleanup())
        loop.close()


def train(model_dir: Path, run_dir: Path, *extra: str) -> list[dict]:
    argv = [
        "train",
        "examples/diffusion_flow_grpo.yaml",
        *overrides(model_dir, "num_steps=3", "diffusion.engine=http", "sync.transport=broadcast"),
        *extra,
        "--run-dir",
        str(run_dir),
    ]
    assert main(argv) == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_cli_trains_through_a_broadcast_group(model_dir, tmp_path, lora_rank):
    steps = train(model_dir, tmp_path / "run", f"model.lora.rank={lora_rank}", "trainer.lr=1e-2")
    assert [r["weight_version"] for r in steps] == [1, 2, 3]
    # steps 2 and 3 sampled after a push: the engine's log-probs are the trainer's
    assert all(r["train/log_prob_mean_abs_diff"] < 1e-6 for r in steps)
    model = tiny.load(model_dir)[0]
    if lora_rank:
        adapters.adapt(model, LORA)
        sent = sum(t.numel() * 4 for t in adapters.adapter_state(model).values())
    else:
        sent = sum(p.numel() * 4 for p in model.parameters())
    assert [r["sync/bytes"] for r in steps] == [sent] * 3
    assert not (tmp_path / "run" / "sync").exists()  # nothing went through the disk
    # the served engine sampled what the trainer's own model samples in process
    argv = [f"model.lora.rank={lora_rank}", "trainer.lr=1e-2", "diffusion.engine=in_process"]
    in_process = train(model_dir, tmp_path / "in_process", *argv, "sync.transport=auto")
    for key in ("rollout/reward_mean", "train/loss"):
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in in_process], abs=1e-5)


def test_the_group_is_nccl_between_two_gpus_only():
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda"), torch.device("cuda:1")
    assert remote.group_backend(cpu, cpu) == "gloo"
    assert remote.group_backend(gpu0, torch.device("cuda:0")) == "gloo"  # one GPU: no NCCL
    assert remote.group_backend(gpu0, gpu1) == "nccl"
    assert remote.group_backend(gpu1, cpu) == "gloo"
