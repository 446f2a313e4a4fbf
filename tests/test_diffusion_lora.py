"""LoRA on the diffusion transformer: adapters alone train, reach the engine (in process and over
HTTP) and equal the merged model there; `verst train ... model.lora.rank=4` runs and resumes."""

import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from tests.servers import LoopThread, start_app  # noqa: E402
from tests.test_diffusion_loop import evaluated, overrides  # noqa: E402
from verst.cli import main  # noqa: E402
from verst.diffusion import adapters, remote, shapes  # noqa: E402
from verst.diffusion import model as tiny  # noqa: E402
from verst.diffusion.checkpoint import load_weights  # noqa: E402
from verst.diffusion.config import DiffusionConfig  # noqa: E402
from verst.diffusion.engine import DiffusionEngine, DiffusionRequest  # noqa: E402
from verst.diffusion.server import DiffusionClient, make_app  # noqa: E402
from verst.diffusion.trainer import DiffusionTrainer  # noqa: E402
from verst.models.lora import LoraConfig, is_adapter  # noqa: E402
from verst.train.trainer import TrainerConfig  # noqa: E402

SPEC = tiny.TinyDiffusionSpec(image_size=8, hidden_size=32, num_layers=1)
LORA = LoraConfig(rank=4, alpha=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("diffusion-lora") / "tiny"
    tiny.create_tiny_diffusion(directory, SPEC, pretrain_steps=2, seed=0, log=lambda _: None)
    return directory


def requests() -> list[DiffusionRequest]:
    return [
        DiffusionRequest(c, num_inference_steps=4, seed=s, record_steps=[0, 1, 2])
        for c in shapes.CAPTIONS[:2]
        for s in range(2)
    ]


def trained_step(model_dir: Path) -> tuple[DiffusionTrainer, DiffusionEngine]:
    """An adapted model after one Flow-GRPO step on its own rollouts (lr large enough that
    the adapters move the samples), and the in-process engine that sampled them."""
    model, meta = tiny.load(model_dir)
    adapters.adapt(model, LORA)
    engine = DiffusionEngine(copy.deepcopy(model), meta["image_size"])
    trajectories = engine.generate(requests())
    trainer = DiffusionTrainer(
        model, DiffusionConfig(clip_range=1.0), TrainerConfig(lr=5e-2), torch.device("cpu"), 0
    )
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    trainer.step(trajectories, advantages, [[0, 1, 2]] * len(trajectories), step=1)
    return trainer, engine


def merged_latents(model_dir: Path, trainer: DiffusionTrainer) -> list[torch.Tensor]:
    plain, meta = tiny.load(model_dir)
    plain.load_state_dict(adapters.merged(trainer.model))
    return [t.latents for t in DiffusionEngine(plain, meta["image_size"]).generate(requests())]


def test_only_the_adapters_train(model_dir):
    base = {n: p.clone() for n, p in tiny.load(model_dir)[0].named_parameters()}
    trainer, _ = trained_step(model_dir)
    stepped = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    named = dict(trainer.model.named_parameters())
    assert stepped == {id(p) for n, p in named.items() if is_adapter(n)} and stepped
    for name, param in named.items():
        if not is_adapter(name):  # the frozen base is the loaded model's, bit for bit
            assert not param.requires_grad
            assert torch.equal(param, base[name.replace(".base_layer.", ".")]), name
    assert any(float(p.detach().abs().max()) > 0 for n, p in named.items() if ".lora_B." in n)


def test_engine_copy_after_a_step_equals_the_merged_model(model_dir):
    trainer, engine = trained_step(model_dir)
    before = [t.latents for t in engine.generate(requests())]
    state = adapters.adapter_state(trainer.model)
    assert state and all(is_adapter(n) for n in state)
    engine.update_weights(state, 1)
    after = [t.latents for t in engine.generate(requests())]
    for mine, merged, old in zip(after, merged_latents(model_dir, trainer), before, strict=True):
        torch.testing.assert_close(mine, merged, atol=1e-5, rtol=0)
        assert (mine - old).abs().max() > 1e-3  # the adapters changed what the engine samples
    with pytest.raises(ValueError, match="update_weights: adapter tensor .* has shape"):
        engine.update_weights({n: t[:1] for n, t in state.items()}, 2)


def test_served_engine_applies_the_pushed_adapter(model_dir, tmp_path):
    trainer, _ = trained_step(model_dir)
    base, meta = tiny.load(model_dir)  # the served engine starts from the frozen base
    served = DiffusionEngine(base, meta["image_size"])
    loop = LoopThread()
    runner, url = loop.run(start_app(make_app(served)))
    try:
        client = DiffusionClient(url)
        sent = remote.push(trainer.model, client, tmp_path, 3, LORA)
        adapter_bytes = sum(t.numel() * 4 for t in adapters.adapter_state(trainer.model).values())
        assert sent == adapter_bytes and served.weight_version == client.weight_version == 3
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["adapter"]
        remote_latents = [t.latents for t in client.generate(requests())]
        for mine, merged in zip(remote_latents, merged_latents(model_dir, trainer), strict=True):
            torch.testing.assert_close(mine, merged, atol=1e-5, rtol=0)
        remote.push(trainer.model, client, tmp_path, 4, LORA)  # a second push replaces weights
        assert served.weight_version == 4
        with pytest.raises(ValueError, match="lora_path: .* is no peft adapter directory"):
            client.load_lora_adapter(tmp_path, 5, name="policy")
        with pytest.raises(ValueError, match="lora_name: this engine holds one adapter"):
            client.load_lora_adapter(tmp_path / "sync" / "adapter", 5, name="other")
    finally:
        loop.run(runner.cleanup())
        loop.close()


def train(model_dir: Path, run_dir: Path, *extra: str, resume: bool = False) -> list[dict]:
    argv = [
        "train",
        "examples/diffusion_flow_grpo.yaml",
        *overrides(model_dir, "model.lora.rank=4", "trainer.lr=1e-2", *extra),
        "--run-dir",
        str(run_dir),
        *(["--resume"] if resume else []),
    ]
    assert main(argv) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_trains_adapters_and_resumes_as_the_uninterrupted_run(model_dir, tmp_path):
    whole = train(model_dir, tmp_path / "whole", "num_steps=2")
    train(model_dir, tmp_path / "cut", "num_steps=1")
    checkpoint = tmp_path / "cut" / "checkpoints" / "step_000001"
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "transformer").exists()
    resumed = train(model_dir, tmp_path / "cut", "num_steps=2", resume=True)
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for key in ("train/loss", "rollout/reward_mean", "train/log_prob_mean_abs_diff"):
        assert resumed[-1][key] == whole[-1][key], key
    assert whole[-1]["train/log_prob_mean_abs_diff"] < 1e-5 and whole[-1]["sync/bytes"] == 0
    with pytest.raises(ValueError, match="holds LoRA adapters"):  # resumed without model.lora
        load_weights(checkpoint, tiny.load(model_dir)[0])


def test_cli_fully_async_pushes_adapters_alone(model_dir, tmp_path):
    records = train(model_dir, tmp_path / "run", "mode=fully_async", "num_steps=2")
    steps = [r for r in records if "train/loss" in r]
    model, _ = tiny.load(model_dir)
    adapters.adapt(model, LoraConfig(rank=4))
    adapter_bytes = sum(t.numel() * 4 for t in adapters.adapter_state(model).values())
    assert [r["sync/bytes"] for r in steps] == [adapter_bytes] * 2
    assert adapter_bytes < sum(p.numel() * 4 for p in model.parameters()) / 4


def test_merge_lora_writes_a_model_that_samples_as_base_and_adapter(model_dir, tmp_path, capsys):
    train(model_dir, tmp_path / "run", "num_steps=1", "trainer.lr=5e-2")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    merged_dir = tmp_path / "merged"
    assert main(["model", "merge-lora", str(model_dir), str(checkpoint), str(merged_dir)]) == 0
    adapted, meta = tiny.load(model_dir)
    adapters.apply_dir(adapted, checkpoint / "adapter", field="adapter")
    plain, _ = tiny.load(merged_dir)  # a plain model directory, usable as model.path
    assert not any(is_adapter(n) for n, _ in plain.named_parameters())
    base = [t.latents for t in DiffusionEngine(tiny.load(model_dir)[0], 8).generate(requests())]
    with_adapter = DiffusionEngine(adapted, meta["image_size"]).generate(requests())
    merged = DiffusionEngine(plain, meta["image_size"]).generate(requests())
    for mine, theirs, before in zip(merged, with_adapter, base, strict=True):
        torch.testing.assert_close(mine.latents, theirs.latents, atol=1e-5, rtol=0)
        assert not torch.allclose(mine.latents, before, atol=1e-4)  # the adapter moved it
    assert main(["model", "merge-lora", str(model_dir), str(tmp_path), str(tmp_path / "x")]) == 2
    # `verst eval` applies a LoRA checkpoint's adapters to model.path: the merged model's scores
    table = evaluated(checkpoint, model_dir, capsys)
    assert table == pytest.approx(evaluated(merged_dir, model_dir, capsys), abs=1e-4)
