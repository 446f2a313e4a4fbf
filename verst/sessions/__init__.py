"""Multi-turn sessions, token in and token out: the chat tokeniser that never re-tokenises an
earlier turn (`templates`), the session store with its append-only history rules (`store`), the
assembly of a session's turns into one training Sample (`assembly`), and the OpenAI-compatible
session server that `verst sessions` runs (`server`)."""

from verst.chat.families import detect_family
from verst.sessions.templates import CHATML_TOOL_TEMPLATE, ChatTokenizer, TurnFormat

__all__ = ["CHATML_TOOL_TEMPLATE", "ChatTokenizer", "TurnFormat", "detect_family"]
