"""API keys for the verst servers (`verst serve`, `verst route`, `verst sessions`), as SGLang
applies its `--api-key` and `--admin-api-key`.

- Ordinary routes need `Authorization: Bearer <api_key>` when an API key is set.
- Control routes (weight updates, pause, flush, worker registration, ...) need the admin key when
  one is set, else the API key when that is set, else nothing.
- `/health...` (and CORS preflight `OPTIONS`) stay open, so probes need no secret.

Keys are compared with `hmac.compare_digest`. With no key configured a server is open, as
SGLang's is; `warn_if_open` says so when it binds beyond loopback. The trainer generates one key
per run (`generate_key`) and hands it to the engine processes it starts through the environment
(`API_KEY_ENV`), never the command line, where `ps` would show it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

API_KEY_ENV = "VERST_API_KEY"
ADMIN_API_KEY_ENV = "VERST_ADMIN_API_KEY"
UNAUTHORIZED = {"error": "Unauthorized"}  # SGLang's body for a missing or wrong key


def generate_key() -> str:
    return secrets.token_urlsafe(32)


def _matches(authorization: str | None, key: str) -> bool:
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())


@dataclass(frozen=True)
class ApiKeys:
    """The keys one server checks (or one client sends); `None` = not configured."""

    api_key: str | None = None
    admin_api_key: str | None = None

    @classmethod
    def resolve(cls, api_key: str | None = None, admin_api_key: str | None = None) -> ApiKeys:
        """Flags win over the environment (`VERST_API_KEY`, `VERST_ADMIN_API_KEY`); an empty
        string is no key."""
        return cls(
            api_key=api_key or os.environ.get(API_KEY_ENV) or None,
            admin_api_key=admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def allows(self, method: str, path: str, authorization: str | None, *, admin: bool) -> bool:
        if method == "OPTIONS" or path.startswith("/health"):
            return True
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return key is None or _matches(authorization, key)

    def headers(self, *, admin: bool = False) -> dict[str, str]:
        """The `Authorization` header a client sends with these keys (none when open)."""
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def env(self) -> dict[str, str]:
        """The environment variables that hand these keys to a child `verst serve`."""
        out = {}
        if self.api_key:
            out[API_KEY_ENV] = self.api_key
        if self.admin_api_key:
            out[ADMIN_API_KEY_ENV] = self.admin_api_key
        return out


def auth_middleware(keys: ApiKeys, is_admin: Callable[[Any], Any]) -> Any:
    """An aiohttp middleware answering 401 to requests without the key their route needs.
    `is_admin(request)` says whether a request is a control request; it may be a coroutine
    function (to look at the body, as `/abort_request` with `abort_all` needs)."""
    import inspect

    from aiohttp import web

    @web.middleware
    async def check_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if keys.enabled and not request.path.startswith("/health"):
            admin = is_admin(request)
            if inspect.isawaitable(admin):
                admin = await admin
            authorization = request.headers.get("Authorization")
            if not keys.allows(request.method, request.path, authorization, admin=bool(admin)):
                return web.json_response(UNAUTHORIZED, status=401)
        return await handler(request)

    return check_api_key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(what: str, host: str, keys: ApiKeys) -> None:
    """A server that binds beyond loopback without a key lets anyone who reaches the port drive
    it: say so on stderr."""
    if not keys.enabled and not is_loopback(host):
        print(
            f"{what}: WARNING: listening on {host} without an API key: anyone who reaches this "
            f"port can use it (set --api-key or {API_KEY_ENV})",
            file=sys.stderr,
            flush=True,
        )
