"""Constrained decoding: a request's output follows a JSON schema, a regular expression or an
EBNF grammar (SGLang's `json_schema`, `regex` and `ebnf`), through `xgrammar`.

`Grammars` (one per scheduler, made on the first constrained request) compiles each grammar
once against the engine's tokenizer (compiled grammars are cached by their text) and gives
each request a matcher of its own. Each sampling step fills one bitmask row per constrained
request from its matcher, applies the whole bitmask to the step's logits in one call (the
masked tokens get −inf, so the log-prob reported is that of the constrained distribution, as
SGLang's), and after sampling advances each matcher by the token it drew. A grammar that is
complete allows only the end-of-sequence tokens. Requests without a grammar cost nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch

GrammarKind = Literal["json_schema", "regex", "ebnf"]
GRAMMAR_FIELDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "ebnf")
INSTALL_HINT = 'constrained decoding needs xgrammar: pip install "verst[grammar]"'


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: `kind` names SGLang's field, `text` its value."""

    kind: GrammarKind
    text: str

    def validate(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ValueError(f"{self.kind} must be a non-empty string, got {self.text!r}")
        if self.kind == "json_schema":
            try:
                json.loads(self.text)
            except json.JSONDecodeError as error:
                raise ValueError(f"json_schema is not valid JSON: {error}") from None


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return xgrammar


class Grammars:
    """Compiled grammars for one tokenizer and vocabulary, and the step's masking."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiled: dict[Constraint, Any] = {}

    @cached_property
    def _compiler(self) -> Any:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        return xgr.GrammarCompiler(info, max_threads=1)

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher of `constraint`; ValueError (naming the field) when it does not
        compile."""
        compiled = self._compiled.get(constraint)
        if compiled is None:
            compiled = self._compiled[constraint] = self._compile(constraint)
        return _xgrammar().GrammarMatcher(compiled)

    def _compile(self, constraint: Constraint) -> Any:
        compiler = self._compiler
        compile_fn = {
            # compact JSON: with whitespace allowed between tokens, a weak model can spend
            # every token on spaces (SGLang allows them unless told otherwise)
            "json_schema": lambda text: compiler.compile_json_schema(text, any_whitespace=False),
            "regex": compiler.compile_regex,
            "ebnf": compiler.compile_grammar,
        }[constraint.kind]
        try:
            return compile_fn(constraint.text)
        except (RuntimeError, ValueError) as error:  # xgrammar's parse errors
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
            raise ValueError(f"{constraint.kind} does not compile: {first}") from None

    def mask(self, matchers: Sequence[Any | None], logits_B_V: torch.Tensor) -> None:
        """Set to −inf, in place, each constrained row's logits of tokens its grammar forbids
        next (rows whose matcher is None are left alone)."""
        xgr = _xgrammar()
        rows = [row for row, m in enumerate(matchers) if m is not None]
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row in rows:
            matchers[row].fill_next_token_bitmask(bitmask, row)
        on_device = bitmask.to(logits_B_V.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits_B_V, on_device, indices=rows)

    @staticmethod
    def accept(matcher: Any, token: int) -> None:
        """Advance `matcher` by the sampled token (which its mask allowed)."""
        if not matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")
