"""Log-probs in OpenAI's shapes, built from a `/generate` item's SGLang triples
(`[logprob, token_id, text]`, text filled): chat's `logprobs.content` and the completions'
legacy `{tokens, token_logprobs, text_offset, top_logprobs}` (the prompt's first, with `echo`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Triple = Sequence[Any]  # [logprob | None, token_id, text]


def chat_logprobs(meta: dict[str, Any]) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion: every output token with its top
    alternatives (an empty list without `top_logprobs`)."""
    tops = meta.get("output_top_logprobs") or []
    content = []
    for i, (logprob, _, text) in enumerate(meta["output_token_logprobs"]):
        top = tops[i] if i < len(tops) and tops[i] else []
        content.append(
            {
                **_token(text, logprob),
                "top_logprobs": [_token(t, lp) for lp, _, t in top],
            }
        )
    return {"content": content}


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}


def completion_logprobs(
    meta: dict[str, Any], *, echo: bool, top: bool, offset: int = 0
) -> dict[str, Any]:
    """`choices[i].logprobs` of a text completion: the prompt's tokens first with `echo` (the
    first with a null log-prob), then the output's. `top_logprobs` holds a {text: logprob} per
    position (null where nothing was scored) when `top`, else is empty; `text_offset` is each
    token's start in the concatenated token texts, counted from `offset` (a stream's chunk
    goes on from the texts of the chunks before it)."""
    triples: list[Triple] = list(meta["output_token_logprobs"])
    top_rows: list[Any] = list(meta.get("output_top_logprobs") or [])
    if echo:
        triples = list(meta["input_token_logprobs"]) + triples
        top_rows = list(meta.get("input_top_logprobs") or []) + top_rows
    offsets = []
    for _, _, text in triples:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [text for _, _, text in triples],
        "token_logprobs": [logprob for logprob, _, _ in triples],
        "text_offset": offsets,
        "top_logprobs": [_top_dict(row) for row in top_rows] if top else [],
    }


def _top_dict(row: Sequence[Triple] | None) -> dict[str, float] | None:
    """One position's alternatives by text; two ids with one text keep the likelier's log-prob
    (rows come likeliest first)."""
    if row is None:
        return None
    entry: dict[str, float] = {}
    for logprob, _, text in row:
        entry.setdefault(text, logprob)
    return entry


OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def output_since(meta: dict[str, Any], start: int) -> dict[str, Any]:
    """`meta` with its output log-prob lists from token `start` on (a stream's new tokens)."""
    return {**meta, **{key: meta[key][start:] for key in OUTPUT_LISTS if key in meta}}
