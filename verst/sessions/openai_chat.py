"""The session server's protocol, pure and without aiohttp: OpenAI chat requests → SGLang
sampling params, upstream `/generate` answers → `TurnRecord`s, and answered turns and
assembled samples → the JSON bodies the server sends back.

Every refusal is a `SessionError` carrying its HTTP status and code.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from verst.models.moe import decode_routed_experts, encode_routed_experts
from verst.sessions.assembly import TurnRecord
from verst.sessions.store import SessionError
from verst.sessions.templates import Message
from verst.types import Sample

if TYPE_CHECKING:
    import torch

# OpenAI request keys mapped onto SGLang's sampling_params; everything else OpenAI defines
# that changes sampling is refused rather than silently ignored.
_SAMPLING_KEYS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "sampling_seed",
}
# Refused at any value but their "off" one. The penalties and logit_bias change the distribution
# tokens are drawn from, so a session's log-probs would not be the policy's the trainer scores;
# tool_choice other than "auto" would change the prompt mid-session or need constrained decoding.
_UNSUPPORTED_KEYS: dict[str, Any] = {
    "tool_choice": "auto",
    "logit_bias": None,
    "response_format": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
}

Decode = Callable[[list[int]], str]


def sample_to_json(sample: Sample) -> dict[str, Any]:
    return {
        "tokens": sample.tokens,
        "prompt_length": sample.prompt_length,
        "response_length": sample.response_length,
        "loss_mask": sample.loss_mask,
        "rollout_logprobs": sample.rollout_logprobs,
        "weight_versions": sample.weight_versions,
        "status": sample.status.value,
        "mismatch": sample.metadata.get("mismatch"),
        "metadata": sample.metadata,
        # base64 int32 [len(tokens) − 1, layers × top_k], as the engine's meta_info has it
        "routed_experts": None
        if sample.routed_experts is None
        else encode_routed_experts(sample.routed_experts),
    }


def _bad(key: str, expected: str, value: Any) -> SessionError:
    return SessionError(400, f"{key} must be {expected}, got {value!r:.80}", "bad_param")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_chat_body(body: dict[str, Any]) -> None:
    """A 400 with a message for a chat body whose fields have the wrong JSON types (the engine
    checks the values themselves)."""
    for key in _SAMPLING_KEYS:
        value = body.get(key)
        if value is None:
            continue
        integral = key in ("max_tokens", "max_completion_tokens", "top_k", "seed")
        if not (_is_int(value) if integral else _is_number(value)):
            raise _bad(key, "an integer" if integral else "a finite number", value)
    for key in ("stream", "logprobs"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _bad(key, "a boolean", body[key])
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", "a string or a list of strings", stop)
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(i) for i in ids)):
        raise _bad("stop_token_ids", "a list of integers", ids)
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise _bad("tools", "a list of objects", tools)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", "a string", body["model"])


def sampling_params(body: dict[str, Any], stop_ids: tuple[int, ...]) -> dict[str, Any]:
    """OpenAI chat parameters → SGLang sampling_params; the family's stop ids always stop."""
    if body.get("n", 1) != 1:
        raise SessionError(400, "n must be 1: a session is one trajectory", "bad_n")
    for key, off in _UNSUPPORTED_KEYS.items():
        if body.get(key) is not None and body[key] != off:
            message = f"{key} {body[key]!r:.60} is not supported by the session server"
            raise SessionError(400, f"{message} (only {off!r})", "bad_param")
    check_chat_body(body)
    params: dict[str, Any] = {}
    for key, name in _SAMPLING_KEYS.items():
        if body.get(key) is not None:
            params[name] = body[key]
    stop = body.get("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    extra = body.get("stop_token_ids") or []
    params["stop_token_ids"] = list(stop_ids) + [i for i in extra if i not in stop_ids]
    return params


def _weight_version(meta: dict[str, Any]) -> int | str:
    """The oldest version that made any token of the turn, so staleness is never understated
    when an update lands mid-turn."""
    spans = meta.get("weight_versions") or []
    version = spans[0]["version"] if spans else meta.get("weight_version", 0)
    try:
        return int(version)
    except (TypeError, ValueError):
        return version


def turn_record(input_ids: list[int], result: dict[str, Any]) -> TurnRecord:
    """An upstream `/generate` answer → the turn's record; a malformed answer is a 502."""
    try:
        meta = result["meta_info"]
        output_ids = [int(i) for i in result["output_ids"]]
        triples = meta["output_token_logprobs"]
        finish = meta["finish_reason"]
        finish_type = finish["type"] if isinstance(finish, dict) else str(finish)
    except (KeyError, TypeError, ValueError) as error:
        raise SessionError(
            502, f"the upstream answer lacks {error} (output_ids / meta_info)", "bad_upstream"
        ) from error
    if [int(t[1]) for t in triples] != output_ids:
        raise SessionError(
            502, "the upstream's output_token_logprobs do not match its output_ids", "bad_upstream"
        )
    logprobs = [float(t[0]) for t in triples]
    routed = _routed_experts(meta, len(input_ids) + len(output_ids) - 1)
    version = _weight_version(meta)
    return TurnRecord(list(input_ids), output_ids, logprobs, version, finish_type, routed)


def _routed_experts(meta: dict[str, Any], rows: int) -> torch.Tensor | None:
    """The answer's `meta_info.routed_experts` (present when asked for) as int32 rows."""
    text = meta.get("routed_experts")
    if text is None:
        return None
    try:
        return decode_routed_experts(text, rows)
    except ValueError as error:
        raise SessionError(502, f"the upstream's {error}", "bad_upstream") from error


@dataclass(frozen=True)
class ChatTurn:
    """One answered turn of a session, as the chat response reports it."""

    session_id: str
    index: int  # the turn's position in the session's records
    record: TurnRecord
    content: str
    tool_calls: list[dict[str, Any]]
    cached_tokens: int

    @property
    def finish_reason(self) -> str:
        finish = self.record.finish_reason
        return "tool_calls" if self.tool_calls and finish == "stop" else finish


def answer_message(content: str, tool_calls: list[dict[str, Any]]) -> Message:
    """The assistant message the session stores: `tool_calls` only when there are some."""
    answer: Message = {"role": "assistant", "content": content}
    if tool_calls:
        answer["tool_calls"] = tool_calls
    return answer


def chat_logprobs(record: TurnRecord, decode: Decode) -> dict[str, Any]:
    """OpenAI's `logprobs.content`: one entry per sampled token, no top log-probs."""
    tokens = (
        (decode([i]), lp) for i, lp in zip(record.output_ids, record.output_logprobs, strict=True)
    )
    return {
        "content": [
            {"token": tok, "bytes": list(tok.encode()), "logprob": lp, "top_logprobs": []}
            for tok, lp in tokens
        ]
    }


def _head(body: dict[str, Any], model_name: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body.get("model") or model_name,
    }


def _usage(turn: ChatTurn) -> dict[str, Any]:
    record = turn.record
    return {
        "prompt_tokens": len(record.input_ids),
        "completion_tokens": len(record.output_ids),
        "total_tokens": len(record.total_ids),
        "prompt_tokens_details": {"cached_tokens": turn.cached_tokens},
    }


def chat_completion(
    turn: ChatTurn, body: dict[str, Any], model_name: str, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    """The `chat.completion` body, with the session's `metadata` (id, turn, weight version)."""
    answer = answer_message(turn.content, turn.tool_calls)
    message = {**answer, "tool_calls": turn.tool_calls or None}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": turn.finish_reason,
    }
    metadata = {
        "session_id": turn.session_id,
        "turn": turn.index,
        "weight_version": turn.record.weight_version,
    }
    head = _head(body, model_name)
    response = {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(turn)}
    return {**response, "metadata": metadata}


def chat_chunk(
    turn: ChatTurn, body: dict[str, Any], model_name: str, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    """The whole turn as one `chat.completion.chunk` (the answer is complete when sent)."""
    delta: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(turn.tool_calls)]
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": turn.finish_reason}
    return {
        **_head(body, model_name),
        "object": "chat.completion.chunk",
        "choices": [choice],
        "usage": _usage(turn),
    }
