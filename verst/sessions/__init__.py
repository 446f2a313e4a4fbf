"""Multi-turn sessions: token-in-token-out chat tokenisation (and, later, the session server)."""

from verst.sessions.templates import CHATML_TOOL_TEMPLATE, ChatTokenizer, TurnFormat, detect_family

__all__ = ["CHATML_TOOL_TEMPLATE", "ChatTokenizer", "TurnFormat", "detect_family"]
