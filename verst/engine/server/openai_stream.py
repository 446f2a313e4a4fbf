"""Streamed `/v1/completions` and `/v1/chat/completions`: OpenAI's chunk objects as tokens decode.

Owns `openai_chunks`, which turns a checked job's merged item streams (`stream_api.merged`,
cumulative results) into OpenAI's stream: per choice, for chat a first chunk with the role
(`delta: {"role": "assistant", "content": ""}`), then chunks with the new text (`delta.content`,
or `text` for completions) and the new tokens' log-probs, the last carrying `finish_reason` and
`matched_stop`; with `stream_options.include_usage`, a final chunk with `choices: []` and the
usage. Every chunk of one response shares its `id` and `created`. A chat request with tools
(`tool_choice` other than none) streams its answer through the incremental tool-call parser
(`openai_tools.ToolCallStream`): content as `delta.content`, each call as OpenAI streams one
(`delta.tool_calls` with its index, id and name, then its `arguments`) once its end is decoded,
and a last chunk with `finish_reason` (`tool_calls` when it made calls).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from verst.engine.server.openai_api import echo_texts, is_echo, openai_finish
from verst.engine.server.openai_logprobs import chat_logprobs, completion_logprobs, output_since
from verst.engine.server.openai_tools import ChatTools, ToolCallStream
from verst.engine.server.sglang_api import GenerateJob
from verst.engine.server.stream_api import merged
from verst.engine.serving import ServingEngine

logger = logging.getLogger(__name__)


@dataclass
class _Sent:
    """What one choice has streamed so far."""

    text: str = ""
    tokens: int = 0
    offset: int = 0  # completions' text_offset of the next token
    role: bool = False  # chat: the role chunk is out
    started: bool = False  # its first content chunk is out


def _new_text(sent: _Sent, text: str) -> str:
    """`text` past what was sent. The streamed text is a prefix of the final one except when a
    `stop_regex` match began in text already sent (which is not taken back)."""
    if text.startswith(sent.text):
        return text[len(sent.text) :]
    logger.warning("a streamed choice's final text does not extend the text sent before it")
    return text[len(os.path.commonprefix([sent.text, text])) :]


class _Shaper:
    """One response's chunks: the choices' state and the fields every chunk carries."""

    def __init__(
        self,
        job: GenerateJob,
        payload: dict[str, Any],
        tokenizer: Any,
        *,
        chat: bool,
        tools: ChatTools | None = None,
        tool_format: str | None = None,
    ):
        self.job, self.chat = job, chat
        self.tokenizer, self.tools, self.tool_format = tokenizer, tools, tool_format
        self.echo = is_echo(payload, chat)
        self.echoed = echo_texts(payload, tokenizer) if self.echo else []
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": "",
        }
        self.sent = [_Sent() for _ in job.items]
        self.tool_streams = (
            [ToolCallStream(tokenizer, tools, tool_format) for _ in job.items] if tools else []
        )
        self.finals: dict[int, dict[str, Any]] = {}

    def chunks(self, index: int, result: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks one cumulative result of choice `index` adds (none when nothing new)."""
        sent, meta = self.sent[index], result["meta_info"]
        out: list[dict[str, Any]] = []
        if self.chat and not sent.role:
            role = {"role": "assistant", "content": ""}
            out.append(self._chunk(index, {"delta": role, "logprobs": None, "finish_reason": None}))
            sent.role = True
        final = meta["finish_reason"] is not None
        if self.tool_streams:
            return out + self._tool_chunks(index, result)
        text = _new_text(sent, result["text"])
        if not sent.started and self.echo:
            text = self.echoed[index // self.job.n] + text
        if not text and not final:
            return out
        choice: dict[str, Any] = {"logprobs": self._logprobs(index, meta, not sent.started)}
        choice.update({"delta": {"content": text} if text else {}} if self.chat else {"text": text})
        finish, matched = openai_finish(meta) if final else (None, None)
        choice.update(finish_reason=finish, matched_stop=matched)
        out.append(self._chunk(index, choice))
        sent.text, sent.started = result["text"], True
        sent.tokens = max(sent.tokens, len(result["output_ids"]))
        if final:
            self.finals[index] = meta
        return out

    def _tool_chunks(self, index: int, result: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks of a chat answer with tools: the parser's deltas, then (when it has
        finished) one with its finish reason. The new tokens' log-probs ride on the first."""
        meta, sent = result["meta_info"], self.sent[index]
        final = meta["finish_reason"] is not None
        stream = self.tool_streams[index]
        choices: list[dict[str, Any]] = [
            {"delta": delta, "finish_reason": None} for delta in stream.deltas(result, final)
        ]
        if final:
            finish, matched = openai_finish(meta)
            if stream.calls and finish == "stop":
                finish, matched = "tool_calls", None
            choices.append({"delta": {}, "finish_reason": finish, "matched_stop": matched})
            self.finals[index] = meta
        if not choices:
            return []
        choices[0]["logprobs"] = self._logprobs(index, meta, not sent.started)
        sent.tokens, sent.started = max(sent.tokens, len(result["output_ids"])), True
        return [self._chunk(index, {"logprobs": None, **choice}) for choice in choices]

    def _logprobs(self, index: int, meta: dict[str, Any], first: bool) -> Any:
        item, sent = self.job.items[index], self.sent[index]
        if not item.return_logprob:
            return None
        new = output_since(meta, sent.tokens)
        if self.chat:
            return chat_logprobs(new)
        top = item.top_logprobs_num > 0
        logprobs = completion_logprobs(new, echo=self.echo and first, top=top, offset=sent.offset)
        sent.offset += sum(len(token) for token in logprobs["tokens"])
        return logprobs

    def _chunk(self, index: int, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [{"index": index, **choice}]}

    def usage(self) -> dict[str, Any]:
        """The usage chunk: prompt tokens once per prompt (its n choices share it)."""
        metas = [self.finals[i] for i in sorted(self.finals)]
        prompt = sum(m["prompt_tokens"] for i, m in enumerate(metas) if i % self.job.n == 0)
        completion = sum(m["completion_tokens"] for m in metas)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return {**self.head, "choices": [], "usage": usage}


async def openai_chunks(
    serving: ServingEngine,
    tokenizer: Any,
    job: GenerateJob,
    payload: dict[str, Any],
    served_model_name: str,
    *,
    chat: bool,
    tools: ChatTools | None = None,
    tool_format: str | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's stream of a checked job (`prepare_openai`, with its tools), chunk by chunk."""
    shaper = _Shaper(job, payload, tokenizer, chat=chat, tools=tools, tool_format=tool_format)
    shaper.head["model"] = served_model_name
    async for index, result in merged(serving, job.items):
        for chunk in shaper.chunks(index, result.to_dict()):
            yield chunk
    if ((payload.get("stream_options") or {}).get("include_usage")) is True:
        yield shaper.usage()
