"""The megatron backend on CPU (gloo, TP = PP = EP = 1): its log-probs equal the HF model's
(the FSDP2 backend's forward) in fp32, a GRPO step matches the FSDP2 step, the exported
weights are the HF tensors, and a checkpoint resumes bit for bit; the DP reduction of the loss
normalisers against closed forms."""

from __future__ import annotations

import copy

import pytest
import torch

from verst.models.tiny import TinyModelConfig, build_tiny_model
from verst.train.algorithms import LossConfig
from verst.train.batching import TrainItem, collate, response_outputs
from verst.train.losses import logprobs_from_logits
from verst.train.megatron.gather import normalisers
from verst.train.trainer import Trainer, TrainerConfig

pytest.importorskip("megatron.core")
VOCAB = 40


def _model(family: str):
    shape = TinyModelConfig(
        family=family, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=48, tie_word_embeddings=family != "llama", num_experts=4,
    )  # fmt: skip
    return build_tiny_model(shape, VOCAB, seed=0)


def _items(seed: int = 0) -> list[TrainItem]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for prompt_len, response_len, advantage in [(5, 4, 1.0), (5, 6, -1.0), (3, 2, 0.5)]:
        tokens = torch.randint(1, VOCAB, (prompt_len + response_len,), generator=gen).tolist()
        if prompt_len == 5:
            tokens[:5] = [7, 8, 9, 10, 11]  # a group: two responses to one prompt
        out.append(TrainItem(tokens, response_len, [1] * response_len, [-1.0] * response_len,
                             advantage))  # fmt: skip
    return out


def _hf_logprobs(model, items):
    micro = collate(items, 0, next(model.parameters()).device)
    with torch.no_grad():
        logits = response_outputs(model, micro).float()
    values = logprobs_from_logits(logits, micro.response_ids_B_T)
    return [values[b, : item.response_length].tolist() for b, item in enumerate(items)]


@pytest.fixture(scope="module")
def megatron_trainers():
    """One parallel state per process: a trainer per family, built in turn."""
    from verst.train.megatron.trainer import MegatronTrainer

    def build(model, **trainer):
        cfg = TrainerConfig(backend="megatron", dtype="float32", device="cpu", lr=1e-3, **trainer)
        return MegatronTrainer(
            copy.deepcopy(model), cfg, LossConfig(), total_steps=4, pad_token_id=0,
            device=torch.device("cpu"),
        )  # fmt: skip

    return build


# the MoE router moves its weight to torch.cuda.current_device() in every forward: MoE runs on
# CUDA only (tests/gpu/test_megatron_cuda.py)
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_logprobs_match_hf(family: str, megatron_trainers) -> None:
    model = _model(family)
    trainer = megatron_trainers(model)
    items = _items()
    ours = trainer.logprobs(items)
    theirs = _hf_logprobs(model, items)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5), (a, b)
    exported = trainer.full_state_dict()
    for name, tensor in model.state_dict().items():
        if name in exported:
            assert torch.equal(exported[name], tensor), name


def test_grpo_step_matches_fsdp2(megatron_trainers) -> None:
    model = _model("qwen3")
    # adam_eps above the backends' gradient round-off (docs/training_backends.md)
    megatron = megatron_trainers(model, adam_eps=1e-5)
    cfg = TrainerConfig(dtype="float32", device="cpu", lr=1e-3, adam_eps=1e-5)
    fsdp = Trainer(copy.deepcopy(model), cfg, LossConfig(), total_steps=4, pad_token_id=0,
                   device=torch.device("cpu"))  # fmt: skip
    items = _items()
    ours, theirs = megatron.step(items, step=1), fsdp.step(items, step=1)
    assert ours["train/loss"] == pytest.approx(theirs["train/loss"], abs=1e-6)
    assert ours["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-4)
    after_ours, after_theirs = megatron.full_state_dict(), fsdp.full_state_dict()
    for name, tensor in after_ours.items():
        assert torch.allclose(tensor, after_theirs[name], atol=1e-6), name


def _adam_moments(trainer) -> dict[str, torch.Tensor]:
    state = trainer.optimizer.state
    return {
        f"{name}.{key}": value
        for name, param in trainer.trainable_parameters
        for key, value in state[param].items()
    }


def test_resumed_trainer_continues_bit_for_bit(megatron_trainers, tmp_path) -> None:
    """Two steps, a checkpoint on disk (HF safetensors + the state file, read back as `--resume`
    reads them), a fresh trainer from the step-0 model loads it, and its third step equals an
    uninterrupted run's exactly: CPU fp32 runs the same kernels on the same bits in the same
    order, the weights' HF <-> Megatron mapping only copies and concatenates, and the Adam
    moments, step counts and LR schedule are restored, so no tolerance is needed."""
    from verst.train.checkpoint import STATE_FILE, load_checkpoint

    model = _model("qwen3")
    settings = dict(lr_warmup_steps=2, lr_schedule="cosine", grad_clip=0.05, weight_decay=0.1)
    uninterrupted = megatron_trainers(model, **settings)
    expected = [uninterrupted.step(_items(seed), step=seed) for seed in (1, 2, 3)]
    want_weights, want_moments = uninterrupted.full_state_dict(), _adam_moments(uninterrupted)

    first = megatron_trainers(model, **settings)
    for seed in (1, 2):
        assert first.step(_items(seed), step=seed)["train/loss"] == expected[seed - 1]["train/loss"]
    model.save_pretrained(tmp_path, state_dict=first.full_state_dict(), safe_serialization=True)
    torch.save({"trainer": first.optimizer_state()}, tmp_path / STATE_FILE)
    del first

    resumed = megatron_trainers(model, **settings)  # starts from the step-0 weights
    weights, state = load_checkpoint(tmp_path)
    resumed.load_state(weights, state["trainer"])
    metrics = resumed.step(_items(3), step=3)
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        assert metrics[key] == expected[2][key], key
    assert expected[2]["train/grad_norm"] > 0.05  # the clip acted on the compared step
    after = resumed.full_state_dict()
    assert after.keys() == want_weights.keys()
    for name, tensor in want_weights.items():
        assert torch.equal(after[name], tensor), name
    moments = _adam_moments(resumed)
    assert moments.keys() == want_moments.keys()
    for name, tensor in want_moments.items():
        assert torch.equal(moments[name], tensor), name


def test_normalisers_reduce_to_one_batch() -> None:
    """Σ over DP ranks of (Σ_rank x·mask / token_norm), ÷ DP = the whole batch's token mean;
    the same for the sequence mean."""
    tokens, sequences = [3.0, 5.0, 0.0], [1.0, 2.0, 0.0]
    token_norm, seq_norm = normalisers(tokens, sequences)
    assert token_norm == pytest.approx(8 / 3) and seq_norm == pytest.approx(1.0)
    per_token = [torch.tensor([1.0, 2.0, 3.0]), torch.arange(5.0), torch.zeros(0)]
    rank_losses = [float(x.sum()) / token_norm for x in per_token]
    assert sum(rank_losses) / 3 == pytest.approx(float(torch.cat(per_token).mean()))
    assert normalisers([0.0, 0.0], [0.0, 0.0]) == (0.5, 0.5)  # an all-masked batch: no 0/0


@pytest.mark.slow
def test_verst_train_with_megatron(tmp_path) -> None:
    """Two GRPO steps through the CLI on the megatron backend: the embedded engine takes the
    exported weights (a copy per push), a checkpoint is written and read back."""
    import json

    from verst.cli import main
    from verst.train.checkpoint import list_checkpoints

    run_dir = tmp_path / "run"
    args = [
        "train", "num_steps=2", "trainer.backend=megatron", "trainer.device=cpu",
        "num_threads=1", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4", "trainer.lr=1e-3", "checkpoint.interval_steps=2",
        "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
        "intermediate_size: 64, max_position_embeddings: 32}",
        "data.task=addition", "--run-dir", str(run_dir),
    ]  # fmt: skip
    assert main(args) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["sync/bytes"] > 0 for r in steps)  # no shared storage: the engine got copies
    assert list_checkpoints(run_dir)


def test_a_layout_that_does_not_fit_fails_through_the_cli_before_any_step(tmp_path, capsys) -> None:
    from verst import exitcodes
    from verst.cli import main

    run_dir = tmp_path / "run"
    args = [
        "train", "trainer.backend=megatron", "trainer.device=cpu", "num_threads=1",
        "trainer.megatron.tensor_parallel=3",
        "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
        "intermediate_size: 64, max_position_embeddings: 32}", "--run-dir", str(run_dir),
    ]  # fmt: skip
    assert main(args) == exitcodes.BAD_INPUT
    err = capsys.readouterr().err
    assert "trainer.megatron.tensor_parallel=3 does not divide the model's 2 heads" in err
    assert not (run_dir / "metrics.jsonl").exists()


def test_megatron_rejects_what_it_does_not_train() -> None:
    from verst.config import RunConfig

    base = {"model": {"tiny": {}}, "trainer": {"backend": "megatron"}}
    with pytest.raises(ValueError, match="does not support model.lora.enabled"):
        RunConfig.model_validate(base | {"model": {"tiny": {}, "lora": {"rank": 4}}})
    with pytest.raises(ValueError, match="loss.advantage_estimator=ppo .a PPO critic"):
        RunConfig.model_validate(base | {"loss": {"advantage_estimator": "ppo"}})
    trained = [  # what the megatron backend trains (tests/test_megatron_objectives.py)
        {"mode": "sft"},
        {"warm_start": {"enabled": True}},
        {"loss": {"kl_loss_coef": 0.1}},
        {"loss": {"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.1}},
        {"loss": {"opd": {"teacher_urls": {"default": "http://127.0.0.1:1"}}}},
    ]
    for extra in trained:
        assert RunConfig.model_validate(base | extra).trainer.backend == "megatron"
