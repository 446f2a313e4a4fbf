"""SGLang's `/v1/tokenize` and `/v1/detokenize` (also served without `/v1`) as plain functions:
request body in, response body out, with the server's own tokenizer.

`{"prompt": str | [str], "add_special_tokens": true}` → `{"tokens", "count", "max_model_len"}`
(a list per prompt for a list); `{"tokens": [int] | [[int]], "skip_special_tokens": true}` →
`{"text"}`. Errors use the OpenAI envelope, as SGLang's do.
"""

from __future__ import annotations

from typing import Any

from verst.engine.server.protocol_errors import openai_error


def _body(payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise openai_error("the request body must be a JSON object")
    return payload


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, True)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise openai_error(f"{key} must be a boolean, got {value!r}")
    return value


def tokenize_body(tokenizer: Any, payload: Any, context_len: int) -> dict[str, Any]:
    body = _body(payload)
    prompt = body.get("prompt")
    add = _flag(body, "add_special_tokens")
    if isinstance(prompt, str):
        tokens: Any = tokenizer.encode(prompt, add_special_tokens=add)
        count: Any = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        tokens = [tokenizer.encode(p, add_special_tokens=add) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        raise openai_error("prompt: Field required (a string or a list of strings)")
    return {"tokens": tokens, "count": count, "max_model_len": context_len}


def detokenize_body(tokenizer: Any, payload: Any, vocab_size: int) -> dict[str, Any]:
    body = _body(payload)
    tokens = body.get("tokens")
    skip = _flag(body, "skip_special_tokens")
    if not isinstance(tokens, list):
        raise openai_error("tokens: Field required (a list of token ids, or of such lists)")
    if not tokens:
        return {"text": ""}
    nested = all(isinstance(t, list) for t in tokens)
    for ids in tokens if nested else [tokens]:
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise openai_error("Invalid input: 'tokens' must be a list of integers.")
            if t < 0 or (vocab_size and t >= vocab_size):
                raise openai_error(f"token id {t} is outside the vocabulary [0, {vocab_size})")
    if nested:
        return {"text": [tokenizer.decode(ids, skip_special_tokens=skip) for ids in tokens]}
    return {"text": tokenizer.decode(tokens, skip_special_tokens=skip)}
