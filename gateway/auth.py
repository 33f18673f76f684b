"""Optional bearer-token check in front of the API routes."""

from __future__ import annotations

import hmac

from gateway.errors import APIError

PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/metrics/bus", "/ping"})


def authorization_headers(scope) -> list[bytes]:
    return [value for name, value in scope.get("headers") or () if name == b"authorization"]


class APIKeyMiddleware:
    """Owns one rule: with an API key configured, every non-public path needs ``Authorization: Bearer KEY``.

    /health, /version and /metrics stay open (probes and scrapers carry no key), as in vLLM.
    The comparison is constant-time. A request with more than one Authorization header is a 400
    on every path: which one counts would be a guess (a proxy and the server may pick differently).
    """

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    def is_authorized(self, scope) -> bool:
        """A key is configured and this request carries it (once)."""
        given = authorization_headers(scope)
        return self.expected is not None and len(given) == 1 and hmac.compare_digest(given[0], self.expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if len(authorization_headers(scope)) > 1:
            await APIError(400, "more than one Authorization header", "authorization").response()(scope, receive, send)
            return
        scope.setdefault("state", {})["is_authorized"] = self.is_authorized(scope)
        if self.expected is None or scope["path"] in PUBLIC_PATHS or scope.get("method") == "OPTIONS" \
                or scope["state"]["is_authorized"]:
            await self.app(scope, receive, send)
            return
        await APIError(401, "invalid or missing API key").response()(scope, receive, send)
