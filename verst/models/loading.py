"""Model and tokenizer loading: a local HF directory, or a random tiny model built in-process.

`ModelConfig` names exactly one source. `load_model_and_tokenizer` never touches the network
(`local_files_only=True`); a missing directory is a FileNotFoundError that says how to make one.
`eos_token_ids` is the single answer to "which ids end a response" for engines and rollouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from verst.configbase import ConfigBase
from verst.models.lora import LoraConfig
from verst.models.tiny import (
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
    tiny_model_config,
)


class ModelConfig(ConfigBase):
    """Where the policy comes from: `path` (an HF directory) or `tiny` (random, in-process)."""

    kind: Literal["causal_lm", "diffusion"] = Field(
        "causal_lm",
        description="causal_lm = a language model; diffusion = a `verst model "
        "create-tiny-diffusion` directory in model.path, trained by the diffusion section",
    )
    path: str | None = Field(None, description="local HF model directory to load")
    tiny: TinyModelConfig | None = Field(
        None, description="build a random tiny model in-process instead of loading `path`"
    )

    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="train low-rank adapters instead of all weights"
    )

    exclusive_fields: ClassVar[tuple[str, ...]] = ("path", "tiny")

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path and model.tiny")
        return self


def load_model_and_tokenizer(
    cfg: ModelConfig,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (or build) the model in `dtype` on `device`, in eval mode, with its tokenizer."""
    if cfg.tiny is not None:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(cfg.tiny, vocab_size=len(tokenizer), seed=seed)
        return model.to(device=device, dtype=dtype), tokenizer
    path = _model_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    model.to(device)
    model.eval()
    return model, tokenizer


def load_model_config(cfg: ModelConfig) -> PretrainedConfig:
    """The HF config of the model `cfg` names, without building or loading any weights."""
    if cfg.tiny is not None:
        return tiny_model_config(cfg.tiny, vocab_size=len(build_char_tokenizer()))[0]
    return AutoConfig.from_pretrained(_model_dir(cfg), local_files_only=True)


def _model_dir(cfg: ModelConfig) -> Path:
    assert cfg.path is not None
    path = Path(cfg.path).expanduser()
    if not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"model directory {str(path)!r} {what}; make a tiny random one with "
            f"`verst model create-tiny {cfg.path}`, or set model.tiny to build one in-process"
        )
    return path


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a response: the generation config's EOS ids, then the tokenizer's."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (gen_eos, tokenizer.eos_token_id):
        if source is None:
            continue
        for token_id in source if isinstance(source, (list, tuple)) else [source]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids
