"""Tiny random models and a character tokenizer, built entirely in-process (no hub downloads).

`build_char_tokenizer` gives a reversible character-level tokenizer with ChatML special tokens
and a Qwen-style chat template: every printable ASCII character and "\\n" is exactly one id, so
token counts in tests are predictable ("07+58=" is 6 ids). `build_tiny_model` gives a random
causal LM of one of the families in `families` (Qwen3 by default) in fp32; `create_tiny` writes
both to an ordinary HF directory that `AutoModelForCausalLM` / `AutoTokenizer` load with
`local_files_only=True`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field, model_validator
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from verst.configbase import ConfigBase
from verst.models.families import FAMILIES, FamilyName, family_config

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


class TinyModelConfig(ConfigBase):
    """Shape of a random tiny model; defaults give ~1M parameters with the char tokenizer."""

    family: FamilyName = Field(
        "qwen3", description=f"architecture of the tiny model: one of {', '.join(FAMILIES)}"
    )
    hidden_size: int = Field(128, gt=0, description="width of the residual stream")
    num_layers: int = Field(4, gt=0, description="number of decoder layers")
    num_heads: int = Field(4, gt=0, description="number of attention (query) heads")
    num_kv_heads: int = Field(2, gt=0, description="number of key/value heads (GQA)")
    intermediate_size: int = Field(384, gt=0, description="hidden width of the MLP")
    max_position_embeddings: int = Field(
        512, gt=0, description="longest sequence (prompt + response) in tokens"
    )
    tie_word_embeddings: bool = Field(
        True, description="share the input embedding and the output head"
    )
    num_experts: int = Field(
        4, gt=0, description="routed experts per MoE layer (qwen3-moe, mixtral, gpt-oss, ...)"
    )
    experts_per_token: int = Field(2, gt=0, description="experts each token is routed to (MoE)")
    sliding_window: int = Field(
        16, gt=0, description="window of the sliding-window layers (mistral, gemma3, gpt-oss)"
    )

    @model_validator(mode="after")
    def _check_heads(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) must be <= "
                f"num_experts ({self.num_experts})"
            )
        return self


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: 3 ChatML specials, 96 characters, then an unknown token."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + [UNK])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One piece per character; "[\s\S]" rather than "." so "\n" is a character like any other.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins pieces with no separator, which keeps decode(encode(s)) == s.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS + [UNK])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        unk_token=UNK,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def tiny_model_config(
    cfg: TinyModelConfig, vocab_size: int
) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    """The HF config of the tiny model `cfg` describes, and the causal-LM class that builds it."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
    )
    return family_config(cfg.family, common, cfg)


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """A random fp32 causal LM; the same (cfg, vocab_size, seed) gives the same weights."""
    config, cls = tiny_model_config(cfg, vocab_size)
    # fork_rng: building a model must not move the caller's global random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32)
    model.eval()
    eos = SPECIAL_TOKENS.index(ENDOFTEXT)
    model.generation_config.eos_token_id = [eos, SPECIAL_TOKENS.index(IM_END)]
    model.generation_config.pad_token_id = eos
    model.generation_config.bos_token_id = None
    return model


def create_tiny(dir: str | Path, cfg: TinyModelConfig | None = None, seed: int = 0) -> None:
    """Write a random tiny model (safetensors) and the char tokenizer to an HF directory."""
    cfg = cfg or TinyModelConfig()
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg, vocab_size=len(tokenizer), seed=seed)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
