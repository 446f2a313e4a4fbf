"""Tiny models, the char tokenizer, model loading, and import-path loading."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from verst.models import (
    ModelConfig,
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
    create_tiny,
    eos_token_ids,
    load_model_and_tokenizer,
)

SMALL = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "07+58="},
    {"role": "assistant", "content": "65"},
    {"role": "user", "content": "1+1="},
]
CHATML = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n07+58=<|im_end|>\n"
    "<|im_start|>assistant\n65<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_char_tokenizer_ids_and_round_trip(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 0
    assert len(tokenizer("07+58=", add_special_tokens=False)["input_ids"]) == 6
    assert len(tokenizer("65", add_special_tokens=False)["input_ids"]) == 2
    assert tokenizer("ab")["input_ids"] == tokenizer("ab", add_special_tokens=False)["input_ids"]
    for text in ["07+58=", "  two  spaces ", "line\nbreak\n", '~!@#$%^&*()_+{}|:"<>?`']:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)
        assert tokenizer.decode(ids) == text
    ids = tokenizer("<|im_start|>hi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 4
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_chat_template(tokenizer):
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == CHATML
    with_prompt = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert with_prompt == CHATML + "<|im_start|>assistant\n"


def test_tokenizer_save_load_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "12+34=\n x"
    assert (
        loaded(text, add_special_tokens=False)["input_ids"]
        == tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.eos_token_id == loaded.pad_token_id == 0
    assert loaded.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    ) == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tiny_model_save_load_equal_logits(family, tmp_path):
    cfg = TinyModelConfig(family=family, **SMALL)
    create_tiny(tmp_path, cfg, seed=3)
    model, tokenizer = load_model_and_tokenizer(ModelConfig(path=str(tmp_path)), seed=0)
    fresh = build_tiny_model(cfg, vocab_size=len(tokenizer), seed=3)
    assert type(model) is type(fresh)
    assert model.dtype == torch.float32
    ids = torch.tensor([tokenizer("07+58=65", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, rtol=0, atol=0)
    assert eos_token_ids(model, tokenizer) == [0, 2]


def test_tiny_model_is_seeded_and_leaves_global_rng_alone():
    cfg = TinyModelConfig(**SMALL)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model(cfg, vocab_size=100, seed=1)
    assert torch.equal(torch.rand(3), expected)
    b = build_tiny_model(cfg, vocab_size=100, seed=1)
    c = build_tiny_model(cfg, vocab_size=100, seed=2)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.generation_config.eos_token_id == [0, 2]
    assert a.generation_config.pad_token_id == 0


def test_load_tiny_in_process():
    model, tokenizer = load_model_and_tokenizer(
        ModelConfig(tiny=TinyModelConfig(family="llama", **SMALL)),
        seed=0,
        dtype=torch.bfloat16,
    )
    assert model.dtype == torch.bfloat16
    assert model.config.vocab_size == len(tokenizer)


def test_model_config_validation(tmp_path):
    with pytest.raises(ValidationError, match="model.path and model.tiny"):
        ModelConfig()
    with pytest.raises(ValidationError, match="model.path and model.tiny"):
        ModelConfig(path="x", tiny=TinyModelConfig())
    with pytest.raises(ValidationError, match="hidden_size"):
        TinyModelConfig(hidden_size=130, num_heads=4)
    with pytest.raises(ValidationError, match="num_kv_heads"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValidationError):
        TinyModelConfig(familly="qwen3")
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="verst model create-tiny") as info:
        load_model_and_tokenizer(ModelConfig(path=str(missing)), seed=0)
    assert str(missing) in str(info.value)


def test_every_config_field_is_described():
    for cls in (TinyModelConfig, ModelConfig):
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"


def test_cli_create_tiny_writes_a_model_verst_train_can_load(tmp_path) -> None:
    from verst.cli import main
    from verst.config import load_config
    from verst.models.loading import load_model_and_tokenizer

    assert main(["model", "create-tiny", str(tmp_path / "m"), "--family", "llama"]) == 0
    cfg = load_config(None, [f"model.path={tmp_path / 'm'}"])
    model, tokenizer = load_model_and_tokenizer(cfg.model, seed=0)
    assert model.config.model_type == "llama"
    assert tokenizer.decode(tokenizer("07+58=")["input_ids"]) == "07+58="
