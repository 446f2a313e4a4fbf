"""Session state and the history rules of the session server, usable in-process.

`SessionStore` creates, finds and deletes sessions, plans each turn (the request's messages
must extend the stored ones append-only; the last assistant turn may be rolled back once; the
tools may not change), commits the engine's answer as a `TurnRecord`, and assembles a session
into a training Sample. Messages are normalised to plain dicts, and tool calls are parsed out
of an answer's text in the format of the template's family (`verst.chat.tool_parsers`).
Every refusal is a `SessionError` carrying its HTTP status and code; `verst.sessions.server`
puts HTTP in front of the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from verst.chat.tool_parsers import parse_tool_calls, parser_text
from verst.sessions.assembly import TurnRecord, assemble
from verst.sessions.templates import ChatTokenizer, Message
from verst.types import Sample

SESSION_TTL_S = 3600.0  # a session unused this long is dropped
MAX_SESSIONS = 10_000  # live sessions at once; one more is a 429

log = logging.getLogger(__name__)
# Mismatch kinds that mean a TITO or template bug (assistant_text is by design for templates
# that drop earlier reasoning).
BUG_MISMATCHES = ("special_token_count", "special_token_type", "non_assistant_text")


class SessionError(Exception):
    """A request the session server refuses: HTTP status, OpenAI-style error code, message."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def body(self) -> dict[str, Any]:
        kinds = {404: "not_found", 429: "rate_limit_error", 502: "bad_gateway"}
        kind = kinds.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "code": self.code, "param": None}}


@dataclass
class Session:
    """One episode's history: messages up to the last answer, and one record per answer."""

    session_id: str
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    records: list[TurnRecord] = field(default_factory=list)
    message_ends: list[int] = field(default_factory=list)  # len(messages) after each answer
    cached_tokens: list[int] = field(default_factory=list)
    created_s: float = field(default_factory=time.time)
    used_s: float = field(default_factory=time.monotonic)  # last request that named it
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    deleted: bool = False

    def summary(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "messages": self.messages,
            "tools": self.tools,
            "num_turns": len(self.records),
            "records": [
                {
                    "input_length": len(r.input_ids),
                    "output_length": len(r.output_ids),
                    "weight_version": r.weight_version,
                    "finish_reason": r.finish_reason,
                    "cached_tokens": cached,
                }
                for r, cached in zip(self.records, self.cached_tokens, strict=True)
            ],
        }


@dataclass(frozen=True)
class TurnPlan:
    """What a chat request turns into: the ids to send and which earlier turns it keeps."""

    input_ids: list[int]
    messages: list[Message]  # the request's messages, normalised
    tools: list[dict[str, Any]] | None
    kept_turns: int  # len(records) without a rollback, one less with one


def normalize_message(message: Any) -> Message:
    """A request message as stored and rendered: text content parts joined into one string."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise SessionError(400, "each message must be an object with a role", "bad_message")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text can be tokenised here
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        if not all(isinstance(t, str) for t in texts):
            raise SessionError(400, "a content part's text must be a string", "bad_message")
        content = "".join(texts)
    if content is None and message["role"] != "assistant":
        content = ""
    if content is not None and not isinstance(content, str):
        raise SessionError(400, "message content must be a string or text parts", "bad_message")
    return {**{k: v for k, v in message.items() if v is not None}, "content": content}


def _tool_call_key(call: Any) -> tuple[str, Any]:
    fn = call.get("function", call) if isinstance(call, dict) else {}
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return str(fn.get("name")), arguments


def same_message(stored: Message, sent: Message) -> bool:
    """Role, content and tool calls agree (ids and extra keys a client adds do not matter)."""
    return (
        stored.get("role") == sent.get("role")
        and (stored.get("content") or "") == (sent.get("content") or "")
        and [_tool_call_key(c) for c in stored.get("tool_calls") or []]
        == [_tool_call_key(c) for c in sent.get("tool_calls") or []]
    )


def parse_answer(
    chat_tokenizer: ChatTokenizer,
    text: str,
    output_ids: list[int],
    tools: list[dict[str, Any]] | None,
) -> tuple[str | None, list[dict[str, Any]]]:
    """An answer's (content, OpenAI tool calls) in the format of the template's family; without
    tools the text is all content. Calls that are not well-formed stay in the content."""
    if not tools:
        return text, []
    fmt = chat_tokenizer.tool_parser
    visible = parser_text(chat_tokenizer.tokenizer, text, output_ids, fmt)
    return parse_tool_calls(visible, fmt, tools)


def _same_tools(a: list[dict[str, Any]] | None, b: list[dict[str, Any]] | None) -> bool:
    return json.dumps(a or None, sort_keys=True) == json.dumps(b or None, sort_keys=True)


class SessionStore:
    """Sessions in memory, the append-only history rule, and assembly into Samples.

    A session unused for `ttl_s` is dropped (found missing: 404); at most `max_sessions` live
    at once, and creating one more is a 429."""

    def __init__(
        self,
        chat_tokenizer: ChatTokenizer,
        *,
        ttl_s: float = SESSION_TTL_S,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self.chat_tokenizer = chat_tokenizer
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}

    def create(self) -> Session:
        self.drop_expired()
        if len(self.sessions) >= self.max_sessions:
            raise SessionError(
                429,
                f"{len(self.sessions)} sessions are open, the server's most (--max-sessions): "
                "delete finished ones or retry later",
                "too_many_sessions",
            )
        session = Session(session_id=uuid.uuid4().hex)
        self.sessions[session.session_id] = session
        return session

    def drop_expired(self) -> list[str]:
        """Drop the sessions unused for `ttl_s` (none with a request in flight)."""
        cutoff = time.monotonic() - self.ttl_s
        expired = [
            sid for sid, s in self.sessions.items() if s.used_s < cutoff and not s.lock.locked()
        ]
        for sid in expired:
            self.sessions.pop(sid).deleted = True
        return expired

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is not None and not session.lock.locked():
            if time.monotonic() - session.used_s > self.ttl_s:
                self.sessions.pop(session_id).deleted = True
        if session is None or session.deleted:
            raise SessionError(404, f"no session {session_id!r}", "session_not_found")
        session.used_s = time.monotonic()
        return session

    def delete(self, session_id: str) -> Session:
        session = self.get(session_id)
        session.deleted = True
        del self.sessions[session_id]
        return session

    def plan_turn(
        self, session: Session, messages: list[Message], tools: list[dict[str, Any]] | None
    ) -> TurnPlan:
        """The ids for a request's messages, or a 400 when they do not extend the history."""
        if not messages:
            raise SessionError(400, "messages must be a non-empty list", "bad_messages")
        if messages[-1]["role"] == "assistant":
            raise SessionError(
                400, "the last message is the assistant's: there is nothing to answer", "bad_turn"
            )
        ends = session.message_ends
        kept = next(
            (
                keep
                for keep in (len(ends), len(ends) - 1)
                if keep >= 0 and self._extends(session, messages, ends[keep - 1] if keep else 0)
            ),
            None,
        )
        if kept is None:
            at = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(session.messages, messages, strict=False))
                    if not same_message(a, b)
                ),
                min(len(session.messages), len(messages)),
            )
            raise SessionError(
                400,
                f"message {at} does not match the session's history "
                f"({len(session.messages)} stored messages, {len(ends)} assistant turns): the "
                "history is append-only, the assistant's messages must be what it generated, and "
                "at most the last assistant turn may be rolled back",
                "history_changed",
            )
        if kept and not _same_tools(session.tools, tools):
            raise SessionError(
                400, "tools changed mid-session: they are part of the prompt", "tools_changed"
            )
        ct = self.chat_tokenizer
        try:
            if kept == 0:
                input_ids = ct.render_prompt(messages, tools)
            else:
                prev = session.records[kept - 1].total_ids
                input_ids = prev + ct.extend(prev, messages[ends[kept - 1] :], tools)
        except ValueError as error:
            raise SessionError(400, str(error), "bad_turn") from error
        except Exception as error:  # the chat template choked on the messages or tools
            message = f"the chat template cannot render these messages: {error}"
            raise SessionError(400, message, "bad_turn") from error
        return TurnPlan(input_ids, messages, tools, kept)

    @staticmethod
    def _extends(session: Session, messages: list[Message], end: int) -> bool:
        return len(messages) > end and all(
            same_message(a, b) for a, b in zip(session.messages[:end], messages[:end], strict=True)
        )

    def commit(
        self, session: Session, plan: TurnPlan, record: TurnRecord, answer: Message, cached: int
    ) -> None:
        kept = plan.kept_turns
        session.records = session.records[:kept] + [record]
        session.cached_tokens = session.cached_tokens[:kept] + [cached]
        session.messages = plan.messages + [answer]
        session.message_ends = session.message_ends[:kept] + [len(session.messages)]
        session.tools = plan.tools

    def assemble(self, session_id: str, max_seq_len: int | None = None) -> Sample:
        """The session as one Sample (see `verst.sessions.assembly`), with `metadata` holding
        the session id and the mismatch counts against a canonical re-render of the kept
        messages (None when the first turn had to be cut inside)."""
        session = self.get(session_id)
        sample = assemble(session.records, max_seq_len=max_seq_len)
        kept = sample.metadata["num_turns"]
        mismatch = None
        if sample.tokens == session.records[kept - 1].total_ids:
            messages = session.messages[: session.message_ends[kept - 1]]
            generated = [False] * (len(sample.tokens) - sample.response_length) + [
                bool(m) for m in sample.loss_mask
            ]
            mismatch = self.chat_tokenizer.mismatch(
                sample.tokens, messages, session.tools, generated
            )
            if any(mismatch[kind] for kind in BUG_MISMATCHES):
                log.warning(
                    "session %s differs from a re-render of its messages beyond assistant text "
                    "(a TITO or chat-template bug): %s",
                    session_id,
                    mismatch,
                )
        sample.prompt = list(session.messages[: session.message_ends[kept - 1]])
        sample.metadata.update(session_id=session_id, mismatch=mismatch)
        return sample
