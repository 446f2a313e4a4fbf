"""Models and tokenizers: tiny in-process builders and local HF-directory loading."""

from verst.models.loading import ModelConfig, eos_token_ids, load_model_and_tokenizer
from verst.models.tiny import (
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
    create_tiny,
)

__all__ = [
    "ModelConfig",
    "TinyModelConfig",
    "build_char_tokenizer",
    "build_tiny_model",
    "create_tiny",
    "eos_token_ids",
    "load_model_and_tokenizer",
]
