"""LoRA RL (`model.lora`): adapters only are trained and synced, the engine applies them in its
own forward with the trainer's log-probs, checkpoints are peft adapters that resume exactly and
merge into an HF model, and bad settings are refused naming the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_lean_decoder import build, prompt_then_decode, runner_for
from tests.test_loop import SMALL, records
from tests.test_sft import TINY, write_jsonl
from tests.test_trainer import embedded_engine, items, make_trainer, tiny_model
from verst.cli import main
from verst.config import ConfigError, load_config
from verst.engine.lean_decoder import LeanDecoder
from verst.models.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    LoraConfig,
    apply_lora,
    has_lora,
    is_adapter,
    wire_name,
)
from verst.models.tiny import TinyModelConfig, create_tiny
from verst.sync.buckets import AdapterTensors
from verst.sync.embedded import EmbeddedSync
from verst.train.checkpoint import list_checkpoints, load_checkpoint

LORA = LoraConfig(rank=8, alpha=16)


def randomise_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """peft starts B at zero (the adapted model is the base); a trained adapter is not."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_lean_forward_applies_adapters_like_peft(kind: str) -> None:
    model = build(kind)
    plain = copy.deepcopy(model).eval()
    apply_lora(model, LORA)
    randomise_adapters(model)
    model.eval()
    assert LeanDecoder.of(model) is not None  # the engine's own forward, not HF's
    lean = prompt_then_decode(runner_for(model, torch.float32, lean=True))
    ids = torch.tensor([[5, 9, 14, 3, 77, 21, 8, 17]])
    with torch.no_grad():
        full, base = model(ids).logits[0], plain(ids).logits[0]  # peft's forward; the base's
    torch.testing.assert_close(lean[0], full[:7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lean[2][0], full[7], atol=1e-5, rtol=1e-5)
    assert (full - base).abs().max() > 1e-2  # the adapters matter


def test_lora_trains_only_adapters_and_the_engine_follows_exactly() -> None:
    model = tiny_model()
    apply_lora(model, LORA)
    randomise_adapters(model)
    engine = embedded_engine(copy.deepcopy(model).eval())
    trainer = make_trainer(model)
    sync = EmbeddedSync(trainer, engine)
    assert sync.zero_copy  # fp32, a world of one: the engine reads the trainer's tensors
    before = {n: p.detach().clone() for n, p in trainer.named_local_parameters()}
    state = trainer.optimizer.state_dict()["param_groups"][0]["params"]
    assert len(state) == sum(is_adapter(n) for n in before)  # optimiser state: adapters only
    for step in (1, 2):
        trainer.step(items(step), step=step)
        assert sync.push(step + 1)["sync/bytes"] == 0.0
    after = dict(trainer.named_local_parameters())
    for name, tensor in before.items():
        changed = not torch.equal(after[name], tensor)
        assert changed == is_adapter(name), name
    engine_params = dict(engine.model.named_parameters())
    for name, tensor in after.items():
        assert torch.equal(engine_params[name].detach(), tensor), name


def test_a_bf16_trainer_keeps_the_frozen_base_in_bf16_and_the_adapters_in_fp32() -> None:
    model = tiny_model()
    apply_lora(model, LORA)
    randomise_adapters(model)
    trainer = make_trainer(model, dtype="bfloat16")
    dtypes = {n: t.dtype for n, t in trainer.named_local_parameters()}
    assert all((d == torch.float32) == is_adapter(n) for n, d in dtypes.items()), dtypes
    before = trainer.adapter_state_dict()
    trainer.step(items(1), step=1)
    after = trainer.adapter_state_dict()
    assert all(t.dtype == torch.float32 for t in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_a_bf16_engine_is_sent_only_the_adapters() -> None:
    model = tiny_model()
    apply_lora(model, LORA)
    engine = embedded_engine(copy.deepcopy(model).to(torch.bfloat16).eval())
    trainer = make_trainer(model)
    sync = EmbeddedSync(trainer, engine)
    assert not sync.zero_copy
    trainer.step(items(), step=1)
    adapters = {n: t for n, t in trainer.named_local_parameters() if is_adapter(n)}
    sent = sync.push(2)["sync/bytes"]
    assert sent == sum(t.numel() * 2 for t in adapters.values())  # bf16: 2 bytes an element
    engine_params = dict(engine.model.named_parameters())
    for name, tensor in adapters.items():
        assert torch.equal(engine_params[name].detach(), tensor.to(torch.bfloat16)), name


def test_a_lora_push_takes_only_the_adapters_from_the_trainer(monkeypatch) -> None:
    """Under FSDP every tensor a push takes is a gather all ranks join, and a cast to the
    engine's dtype: the frozen base must not be taken only to be dropped."""
    import verst.train.trainer as trainer_module

    taken: list[str] = []
    walk = trainer_module.full_parameters

    def recording(*args, **kwargs):
        for name, tensor in walk(*args, **kwargs):
            taken.append(name)
            yield name, tensor

    monkeypatch.setattr(trainer_module, "full_parameters", recording)
    model = tiny_model()
    apply_lora(model, LORA)
    engine = embedded_engine(copy.deepcopy(model).to(torch.bfloat16).eval())
    sync = EmbeddedSync(make_trainer(model), engine)
    assert sync.push(2)["sync/bytes"] > 0
    assert taken and all(is_adapter(name) for name in taken), taken


def test_adapter_tensors_read_the_current_values_every_call() -> None:
    """`AdapterTensors` walks the trainer's parameters once and casts with one kernel a call:
    every call still sees the values of now (an optimiser step writes in place) and a parameter
    given new storage (a checkpoint loaded by assignment) is walked again."""
    model = tiny_model()
    apply_lora(model, LORA)
    trainer = make_trainer(model)
    read = AdapterTensors(trainer.trainable_parameters, torch.bfloat16)

    def expected() -> dict[str, torch.Tensor]:
        return {
            wire_name(n): p.detach().to(torch.bfloat16)
            for n, p in trainer.named_local_parameters()
            if is_adapter(n)
        }

    def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
        return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    assert same(dict(read()), expected())
    trainer.step(items(), step=1)
    assert same(dict(read()), expected())
    name, param = next((n, p) for n, p in trainer.trainable_parameters if is_adapter(n))
    with torch.no_grad():
        local = param._local_tensor if hasattr(param, "_local_tensor") else param
        local.data = torch.full_like(local, 0.5)
    got = dict(read())
    assert torch.all(got[wire_name(name)] == 0.5) and same(got, expected())


def test_targets_that_match_nothing_name_the_field_and_change_nothing() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules.*q_proj"):
        apply_lora(model, LoraConfig(rank=4, target_modules=["attention_dense"]))
    assert not has_lora(model)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("model.lora.rank=-1", "model.lora.rank"),
        ("model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.dropout=1.5", "model.lora.dropout"),
        ("model.lora.target_modules=5", "model.lora.target_modules"),
    ],
)
def test_bad_lora_settings_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_cli_refuses_targets_that_match_nothing(tmp_path: Path, capsys) -> None:
    args = ["train", *SMALL, "model.lora={rank: 4, target_modules: [nope]}"]
    assert main([*args, "--run-dir", str(tmp_path / "run")]) == 2
    assert "model.lora.target_modules" in capsys.readouterr().err


def lora_args(base: Path) -> list[str]:
    shape = [a for a in SMALL if not a.startswith("model.tiny=")]
    return [
        *shape,
        f"model.path={base}",
        "model.lora={rank: 8, alpha: 16}",
        "rollout.reward=tests.restart_rewards:response_chars",  # rewards differ in a group
        "loss.kl_loss_coef=0.01",  # a reference model: the policy with its adapters merged
        "trainer.lr=1e-2",
    ]


def test_lora_rl_is_on_policy_resumes_exactly_and_merges(tmp_path: Path) -> None:
    base = tiny_base(tmp_path / "base")
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert main(["train", *lora_args(base), "--run-dir", str(straight)]) == 0
    rows = records(straight)[1:]
    for row in rows:
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-5, row
        assert row["train/grad_norm"] > 0 and row["sync/bytes"] == 0.0
    # a checkpoint is a peft adapter; B moved from its zero start
    final = list_checkpoints(straight)[-1]
    assert (final / ADAPTER_CONFIG_FILE).is_file() and not (final / "config.json").exists()
    saved = load_file(final / ADAPTER_WEIGHTS_FILE)
    assert all(k.startswith("base_model.model.") for k in saved)
    assert any(k.endswith("lora_B.weight") and t.abs().max() > 0 for k, t in saved.items())

    assert main(["train", *lora_args(base), "num_steps=2", "--run-dir", str(interrupted)]) == 0
    resume = ["train", *lora_args(base), "--run-dir", str(interrupted), "--resume"]
    assert main(resume) == 0
    a, b = records(straight), records(interrupted)
    for key in ("rollout/reward_mean", "train/loss"):
        assert [r[key] for r in a[1:]] == pytest.approx([r[key] for r in b[1:]], abs=1e-6), key
    final_a, _ = load_checkpoint(final)
    final_b, _ = load_checkpoint(list_checkpoints(interrupted)[-1])
    assert final_a.keys() == final_b.keys() and all(is_adapter(k) for k in final_a)
    for name, tensor in final_a.items():
        torch.testing.assert_close(final_b[name], tensor, atol=1e-6, rtol=1e-5)

    merged_dir = tmp_path / "merged"
    assert main(["model", "merge-lora", str(base), str(final), str(merged_dir)]) == 0
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(merged_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not has_lora(merged)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), final).eval()
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    ids = torch.tensor([[5, 9, 14, 3, 7, 21, 8, 17]])
    with torch.no_grad():
        want, got = adapted(ids).logits, merged(ids).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert (plain(ids).logits - got).abs().max() > 1e-4


def tiny_base(path: Path) -> Path:
    shape = TinyModelConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    create_tiny(path, shape)
    return path


def adapter_bytes(run_dir: Path) -> int:
    saved = load_file(list_checkpoints(run_dir)[-1] / ADAPTER_WEIGHTS_FILE)
    return sum(t.numel() * t.element_size() for t in saved.values())


@pytest.mark.parametrize(
    "placement",
    [
        ["placement.engines=in_process", "sync.transport=colocated"],
        ["placement.engines=in_process", "sync.transport=disk"],
        ["placement.engines=processes", "sync.transport=broadcast"],
        ["placement.engines=processes", "sync.transport=colocated"],
    ],
    ids=["in_process-copy", "in_process-disk", "processes-broadcast", "processes-shm"],
)
def test_serving_engines_hold_the_adapter_and_are_sent_only_it(
    tmp_path: Path, placement: list[str]
) -> None:
    """Serving engines keep the frozen base they loaded and take the adapter alone each step,
    under `policy` (/generate's lora_path): the trainer's log-probs match theirs as with the
    embedded engine, and `sync/bytes` is the adapter's size."""
    base = tiny_base(tmp_path / "base")
    run = tmp_path / "run"
    args = [*lora_args(base), "num_steps=3", *placement, "checkpoint.interval_steps=3"]
    assert main(["train", *args, "--run-dir", str(run)]) == 0
    rows = records(run)[1:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-5, row
        assert row["sync/bytes"] == adapter_bytes(run), row
    assert rows[-1]["train/grad_norm"] > 0


def test_full_state_dict_is_the_policy_with_adapters_merged() -> None:
    """What the KL reference, the critic and `save_pretrained` take: a plain HF model that
    computes what the adapted policy computes."""
    model = tiny_model()
    apply_lora(model, LORA)
    randomise_adapters(model)
    trainer = make_trainer(model)
    plain = tiny_model(seed=1)
    plain.load_state_dict(trainer.full_state_dict())
    ids = torch.tensor([[5, 9, 14, 3, 7, 21, 8, 17]])
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, trainer.model(ids).logits)


def test_sft_with_lora_trains_and_saves_an_adapter(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}?", "completion": f"{i}!"} for i in range(8)]
    data = write_jsonl(tmp_path / "pc.jsonl", rows)
    args = ["sft", *TINY, f"sft.data={{path: {data}}}", "sft.batch_size=4", "sft.epochs=2"]
    args += ["model.lora.rank=4", "trainer.lr=1e-2", "--run-dir", str(tmp_path / "run")]
    assert main(args) == 0
    losses = [r["sft/loss"] for r in records(tmp_path / "run") if "sft/loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    adapters, _ = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])
    assert adapters and all(is_adapter(name) for name in adapters)


LORA_RECIPE = Path(__file__).parent.parent / "examples" / "lora.yaml"


def test_lora_recipe_loads_and_runs_two_steps(tmp_path: Path) -> None:
    """examples/lora.yaml: LoRA GRPO on an SFT checkpoint given as model.path (here a random
    tiny one, and a tiny batch: the recipe's learning is measured in docs/training.md)."""
    with pytest.raises(ConfigError, match="model.path"):  # the base comes on the command line
        load_config(LORA_RECIPE)
    base = tmp_path / "base"
    shape = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    create_tiny(base, TinyModelConfig(**shape, max_position_embeddings=32))
    cfg = load_config(LORA_RECIPE, [f"model.path={base}"])
    assert cfg.model.lora.rank == 32 and cfg.model.lora.alpha == 64
    assert cfg.model.lora.target_modules == "all-linear" and cfg.trainer.lr == 3e-3
    tiny = ["num_steps=2", "num_threads=1", "trainer.device=cpu", "eval.interval_steps=2"]
    tiny += [
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=4",
        "eval.data.max_prompts=8",
    ]
    run_dir = tmp_path / "run"
    args = ["train", str(LORA_RECIPE), f"model.path={base}", *tiny, "--run-dir", str(run_dir)]
    assert main(args) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    adapters, _ = load_checkpoint(list_checkpoints(run_dir)[-1])
    assert adapters and all(is_adapter(name) for name in adapters)
