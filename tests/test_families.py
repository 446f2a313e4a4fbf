"""Every tiny model family through the engine, the trainer and the disk: the engine's greedy
output is HF's, its log-probs are a full forward's (fp32), a GRPO step runs through `verst
train`, and a saved model (created or trained) loads back to the same logits."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from verst.cli import main
from verst.engine import GenerateRequest, SamplingParams, Scheduler
from verst.models import (
    ModelConfig,
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
    load_model_and_tokenizer,
)
from verst.models.families import FAMILIES
from verst.train.checkpoint import list_checkpoints
from verst.types import Sample

# a window of 8 tokens: the prompts and responses below cross it
SHAPE = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    sliding_window=8,
)
VOCAB = len(build_char_tokenizer())
PROMPTS = [[5, 9, 14, 3, 77, 21, 8, 30, 31, 32, 60], [40, 2, 11], [7]]
NEW_TOKENS = 14
LEAN = {"qwen3", "qwen2", "llama", "llama3", "mistral"}  # the engine's own forward reads these


def tiny_config(family: str) -> TinyModelConfig:
    return TinyModelConfig(family=family, **SHAPE)


@cache
def tiny(family: str) -> PreTrainedModel:
    return build_tiny_model(tiny_config(family), vocab_size=VOCAB, seed=0)


def engine(model: PreTrainedModel, seed: int = 0) -> Scheduler:
    return Scheduler.for_model(
        model, eos_token_ids=[], pad_token_id=0, seed=seed, kv_cache_bytes=4 << 20, page_size=4
    )


def engine_outputs(model: PreTrainedModel, temperature: float, seed: int = 0) -> list:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, ignore_eos=True)
    return engine(model, seed).generate([GenerateRequest(list(p), params) for p in PROMPTS])


def test_every_family_is_covered_and_tiny() -> None:
    assert set(FAMILIES) == LEAN | {
        "qwen3-moe",
        "gemma3",
        "glm4",
        "gpt-oss",
        "deepseek-v3",
        "mixtral",
    }
    assert max(len(p) for p in PROMPTS) + NEW_TOKENS > SHAPE["sliding_window"]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_equals_hf_generate(family: str) -> None:
    model = tiny(family)
    scheduler = engine(model)
    assert (scheduler.runner.lean is not None) == (family in LEAN)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = scheduler.generate([GenerateRequest(list(p), params) for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.output_ids == hf[0, len(prompt) :].tolist()
    # a continuation reuses the cached prompt (a prefill after cached tokens, past the window)
    first = outs[0].output_ids
    params = SamplingParams(max_new_tokens=NEW_TOKENS - 6, temperature=0.0, ignore_eos=True)
    (again,) = scheduler.generate([GenerateRequest(PROMPTS[0] + first[:6], params)])
    assert scheduler.cache_stats()["hit_tokens"] > 0
    assert again.output_ids == first[6:]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_logprobs_equal_a_full_forward(family: str) -> None:
    model = tiny(family)
    for prompt, out in zip(PROMPTS, engine_outputs(model, temperature=1.0), strict=True):
        ids = torch.tensor([prompt + out.output_ids[:-1]])
        with torch.no_grad():
            logits_T_V = model(ids).logits[0, len(prompt) - 1 :].float()
        expected = torch.log_softmax(logits_T_V, dim=-1)
        expected = expected.gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
        got = torch.tensor(out.output_token_logprobs)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_create_tiny_saves_a_model_that_reloads_the_same(family: str, tmp_path: Path) -> None:
    assert main(["model", "create-tiny", str(tmp_path), "--family", family]) == 0
    loaded, tokenizer = load_model_and_tokenizer(ModelConfig(path=str(tmp_path)), seed=0)
    config = TinyModelConfig(family=family)  # the CLI's shape is the default one
    fresh = build_tiny_model(config, vocab_size=len(tokenizer), seed=0)
    assert type(loaded) is type(fresh)
    ids = torch.tensor([tokenizer("07+58=65", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, fresh(ids).logits, rtol=0, atol=0)


def even_tokens(sample: Sample) -> float:
    """A reward that random responses differ in (a random model rarely answers right), so a
    group's advantages are not all zero: the share of response ids that are even."""
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    return sum(t % 2 == 0 for t in response) / max(1, len(response))


def train_one_step(family: str, tmp_path: Path) -> None:
    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    tiny(family).save_pretrained(model_dir)
    build_char_tokenizer().save_pretrained(model_dir)
    args = [
        "train",
        f"model.path={model_dir}",
        "num_steps=1",
        "trainer.device=cpu",
        "num_threads=1",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "rollout.temperature=1.0",
        f"rollout.reward={__name__}:even_tokens",
        "loss.advantage_estimator=grpo",
        "eval.interval_steps=0",
        "checkpoint.interval_steps=1",
        "--run-dir",
        str(run_dir),
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = rows[-1]
    assert trained["step"] == 1 and math.isfinite(trained["train/loss"])
    assert math.isfinite(trained["train/grad_norm"]) and trained["train/grad_norm"] > 0
    assert trained["train/train_rollout_logprob_abs_diff"] < 1e-4
    # the trained checkpoint loads as the same architecture, with weights that moved
    checkpoint = list_checkpoints(run_dir)[-1]
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    assert type(reloaded) is type(tiny(family))
    before = dict(tiny(family).named_parameters())
    moved = [n for n, p in reloaded.named_parameters() if not torch.equal(p, before[n])]
    assert moved


@pytest.mark.parametrize("family", FAMILIES)
def test_one_grpo_step_through_verst_train(family: str, tmp_path: Path) -> None:
    train_one_step(family, tmp_path)
