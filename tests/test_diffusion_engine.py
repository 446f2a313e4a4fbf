"""The diffusion engine in process and over HTTP, replayed by the trainer; rewards; bad config."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from tests.servers import LoopThread, start_app  # noqa: E402
from verst.config import ConfigError, load_config  # noqa: E402
from verst.diffusion import model as tiny  # noqa: E402
from verst.diffusion import shapes
from verst.diffusion.config import DiffusionConfig  # noqa: E402
from verst.diffusion.engine import DiffusionEngine, DiffusionRequest  # noqa: E402
from verst.diffusion.rewards import ClipScore, load_reward, shape_colour  # noqa: E402
from verst.diffusion.server import DiffusionClient, make_app  # noqa: E402
from verst.diffusion.trainer import DiffusionTrainer  # noqa: E402
from verst.train.trainer import TrainerConfig  # noqa: E402

SPEC = tiny.TinyDiffusionSpec(image_size=8, patch_size=2, hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-diffusion")
    tiny.create_tiny_diffusion(directory, SPEC, pretrain_steps=3, seed=0, log=lambda _: None)
    return directory


def engine_for(model_dir: Path) -> DiffusionEngine:
    model, meta = tiny.load(model_dir)
    return DiffusionEngine(model, meta["image_size"])


def requests(
    sde_type="flow_sde", eta=0.7, guidance=1.0, record=(0, 1, 2)
) -> list[DiffusionRequest]:
    return [
        DiffusionRequest(
            caption,
            "a blue square" if guidance != 1 else "",
            4,
            guidance,
            seed=s,
            sde_type=sde_type,
            noise_level=eta,
            record_steps=list(record),
        )
        for caption in shapes.CAPTIONS[:3]
        for s in range(2)
    ]


def test_generation_is_seeded_and_records_what_was_asked(model_dir):
    engine = engine_for(model_dir)
    a, b = engine.generate(requests()), engine.generate(requests())
    assert len(a) == 6 and a[0].latents.shape == (5, 3, 8, 8) and a[0].log_probs.shape == (3,)
    assert torch.equal(a[0].latents, b[0].latents) and not torch.equal(a[0].latents, a[1].latents)
    ode = engine.generate(requests("ode", 0.0, record=()))
    assert ode[0].log_probs.numel() == 0 and 0 <= float(ode[0].image.min())
    with pytest.raises(ValueError, match="unknown SDE type"):
        engine.generate([DiffusionRequest("a red circle", sde_type="ddpm")])
    with pytest.raises(ValueError, match="prompt: 'a pink cat'"):
        engine.generate([DiffusionRequest("a pink cat")])


@pytest.mark.parametrize(("sde_type", "guidance"), [("flow_sde", 1.0), ("cps", 2.5)])
def test_trainer_replays_the_engines_log_probs(model_dir, sde_type, guidance):
    engine = engine_for(model_dir)
    trajectories = engine.generate(requests(sde_type, 0.7, guidance))
    cfg = DiffusionConfig(sde_type=sde_type, micro_batch=4)
    trainer = DiffusionTrainer(engine.model, cfg, TrainerConfig(lr=1e-4), torch.device("cpu"), 0)
    advantages = torch.linspace(-1, 1, len(trajectories))
    metrics = trainer.step(trajectories, advantages, [[0, 1, 2]] * len(trajectories), step=1)
    assert metrics["train/log_prob_mean_abs_diff"] < 1e-5
    assert metrics["train/transitions"] == 18 and metrics["train/grad_norm"] > 0
    before = [p.clone() for p in engine.model.parameters()]
    nft = DiffusionTrainer(
        engine.model,
        DiffusionConfig(algorithm="nft", sde_type="ode", noise_level=0),
        TrainerConfig(lr=1e-3),
        torch.device("cpu"),
        0,
    )
    assert torch.isfinite(
        torch.tensor(
            nft.step(trajectories, advantages, [[1, 2]] * len(trajectories), step=1)["train/loss"]
        )
    )
    assert any(
        not torch.equal(p, q) for p, q in zip(before, engine.model.parameters(), strict=True)
    )


def test_http_route_returns_the_in_process_trajectories(model_dir, tmp_path):
    local = engine_for(model_dir).generate(requests())
    served = engine_for(model_dir)
    loop = LoopThread()
    runner, url = loop.run(start_app(make_app(served)))
    try:
        client = DiffusionClient(url)
        remote = client.generate(requests())
        for a, b in zip(local, remote, strict=True):
            assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
            assert (a.label, a.record_steps) == (b.label, b.record_steps)
        with pytest.raises(ValueError, match=r"requests\[0\]\.sde_type: unknown SDE type"):
            client.generate([DiffusionRequest("a red circle", sde_type="ddim")])
        with pytest.raises(ValueError, match="record_steps: step index 9"):
            client.generate(
                [DiffusionRequest("a red circle", num_inference_steps=4, record_steps=[9])]
            )
        changed = engine_for(model_dir).model
        torch.nn.init.zeros_(next(changed.parameters()))
        changed.save_pretrained(tmp_path / "transformer")
        client.update_weights_from_disk(tmp_path, 7)
        assert torch.equal(next(served.model.parameters()), next(changed.parameters()))
        assert served.weight_version == 7
    finally:
        loop.run(runner.cleanup())
        loop.close()


def test_shape_colour_prefers_the_requested_drawing():
    gen = torch.Generator().manual_seed(0)
    circles = torch.stack([shapes.draw("a red circle", 16, gen) for _ in range(4)])
    right = shape_colour(circles, ["a red circle"] * 4)
    wrong_colour = shape_colour(circles, ["a blue circle"] * 4)
    wrong_shape = shape_colour(circles, ["a red triangle"] * 4)
    assert min(right) > 0.85 and max(wrong_colour) == 0.0 and sum(wrong_shape) < sum(right)
    assert shape_colour(torch.zeros(1, 3, 16, 16), ["a red circle"]) == [0.0]
    with pytest.raises(Exception, match="diffusion.reward: unknown image reward 'pixels'"):
        load_reward("pixels", None)


def test_clip_adapter_scores_with_a_local_tiny_clip(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "a", *shapes.COLOURS, *shapes.SHAPES]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]"
    ).save_pretrained(tmp_path)
    small = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    config = CLIPConfig(
        text_config=small | {"vocab_size": len(words), "max_position_embeddings": 16},
        vision_config=small | {"image_size": 16, "patch_size": 8},
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(tmp_path)
    scorer = load_reward("clip", str(tmp_path))
    assert isinstance(scorer, ClipScore)
    scores = scorer(torch.rand(3, 3, 16, 16), ["a red circle", "a blue square", "a green triangle"])
    assert len(scores) == 3 and all(
        abs(s) <= scorer.model.logit_scale.exp().item() / 26 for s in scores
    )


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="model.path: model.kind=diffusion"):
        load_config(None, ["model.kind=diffusion", "model.tiny.family=qwen3"])
    with pytest.raises(ConfigError, match="sde_type=ode has no transition log-probs"):
        load_config(
            None,
            [
                "model.kind=diffusion",
                f"model.path={tmp_path}",
                "diffusion.sde_type=ode",
                "diffusion.noise_level=0",
            ],
        )
    with pytest.raises(ConfigError, match="diffusion.sde_type"):
        load_config(
            None, ["model.kind=diffusion", f"model.path={tmp_path}", "diffusion.sde_type=sde"]
        )
    with pytest.raises(FileNotFoundError, match="create-tiny-diffusion"):
        tiny.load(tmp_path / "missing")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "placement.engines=processes",
            "placement.engines: a diffusion run does not use placement",
        ),
        ("placement.num_engines=2", "diffusion.engine places the engine"),
        ("fault_tolerance.enabled=true", "fault_tolerance.enabled: a diffusion run does not"),
        ("sync.transport=broadcast", "broadcast needs a served engine: diffusion.engine=http"),
        ("sync.transport=disk", "sync.transport=disk: with diffusion.engine=in_process"),
        ("sync.bucket_mb=8", "sync.bucket_mb: a diffusion run pushes whole weights"),
        ("model.lora.dropout=0.1", "model.lora.dropout: the diffusion trainer runs the model"),
        ("diffusion.engine_device=cuda:1", "diffusion.engine_device places a served engine"),
    ],
)
def test_fields_a_diffusion_run_would_ignore_are_refused(tmp_path, override, message):
    base = ["model.kind=diffusion", f"model.path={tmp_path}", "model.lora.rank=4"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, override])


def test_transport_named_as_diffusion_engine_does_it_is_accepted(tmp_path):
    base = ["model.kind=diffusion", f"model.path={tmp_path}"]
    cfg = load_config(None, [*base, "diffusion.engine=http", "sync.transport=disk"])
    assert cfg.sync.transport == "disk"
    assert load_config(None, [*base, "sync.transport=colocated"]).diffusion.engine == "in_process"
    served = [*base, "diffusion.engine=http", "sync.transport=broadcast", "sync.bucket_mb=8"]
    assert load_config(None, served).sync.bucket_mb == 8
    with pytest.raises(ConfigError, match="sync.disk_mode: a diffusion run pushes whole weights"):
        load_config(None, [*served, "sync.disk_mode=full"])
