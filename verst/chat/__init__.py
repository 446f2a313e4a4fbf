"""Chat-template families and their tool-call formats, shared by the session server and the
engine server: one registry keyed by family name (`families.FAMILIES`) names each family's
assistant-turn framing, its stop tokens and its tool-call parser (`tool_parsers`), and ships a
template file for the families verst renders itself (`verst/chat/templates/`)."""

from verst.chat.families import FAMILIES, ChatFamily, detect_family, get_family, load_template
from verst.chat.tool_parsers import TOOL_PARSERS, ParsedDelta, ToolCallParser, parse_tool_calls

__all__ = [
    "FAMILIES",
    "TOOL_PARSERS",
    "ChatFamily",
    "ParsedDelta",
    "ToolCallParser",
    "detect_family",
    "get_family",
    "load_template",
    "parse_tool_calls",
]
