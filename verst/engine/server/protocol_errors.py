"""The engine server's protocol errors: `ProtocolError`, a refused request with the HTTP status
and body to answer it with, and one constructor per envelope SGLang answers in (the S23
contract's, SGLang's native ValueError, FastAPI's validation, OpenAI's). Every protocol module
raises these; the aiohttp handlers answer with them, the in-process client raises `EngineError`.
"""

from __future__ import annotations

from typing import Any


class ProtocolError(Exception):
    """A request the server answers with `status` and `body` (SGLang's envelope for the case)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body


def contract_error(message: str) -> ProtocolError:
    """S23 contract violations (wrong type, unknown sampling key): `{"error": "<text>"}`."""
    return ProtocolError(400, {"error": message})


def value_error(message: str, status: int = 400) -> ProtocolError:
    """SGLang's native ValueError envelope: `{"error": {"message": ...}}`."""
    return ProtocolError(status, {"error": {"message": message}})


def validation_error(message: str, *, err_type: str = "Bad Request") -> ProtocolError:
    """FastAPI validation (bad JSON, missing field) and OpenAI errors: the full envelope."""
    return ProtocolError(
        400, {"object": "error", "message": message, "type": err_type, "param": None, "code": 400}
    )


def openai_error(message: str) -> ProtocolError:
    return validation_error(message, err_type="BadRequestError")
